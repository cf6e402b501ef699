"""Speculative decoding under tensor parallel (gloo ranks on 127.0.0.1, the mp executor): every rank verifies the
scheduler's drafts against the same all-gathered logits, and MTP's layer runs on every rank over its TP-sharded
weights. Greedy tokens identical to one process with the same proposer - and the drafting identical too (same
drafts, same accepted counts per position) - through chunked prefill and prefix hits, with every block back in the
pool. Data parallel with speculative decoding is still refused at start-up, naming both settings."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import make_dense_checkpoint

from openinfer import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_deepseek_checkpoint import make_v3  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # two worker processes per test

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)


def run(llm: LLM, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [o.outputs[0].logprobs[i][t] for i, t in enumerate(o.outputs[0].token_ids)])
            for o in outs]


def spec_counts(llm: LLM) -> tuple:
    s = llm.engine.stats().spec_decode
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_pos)


def compare_tp2(path: Path, prompts, spec: dict, **kw) -> tuple:
    """One process and TP = 2 with the same proposer, twice each (the second pass hits the prefix cache)."""
    kw = dict(dtype="float32", kv_cache_memory_gb=0.02, max_num_batched_tokens=16, speculative_config=spec, **kw)
    results = []
    for layout in ({}, {"tensor_parallel_size": 2}):
        llm = LLM(str(path), **kw, **layout)
        first, again = run(llm, prompts), run(llm, prompts)
        results.append((first, again, spec_counts(llm), llm.engine.stats().prefix_cache_hits))
        assert llm.engine.core.kv.all_free()
        llm.engine.shutdown()
    (one, one_again, one_counts, _), (tp, tp_again, tp_counts, tp_hits) = results
    for a, b in zip(one + one_again, tp + tp_again):
        assert a[0] == b[0]
        assert max(abs(x - y) for x, y in zip(a[1], b[1])) < 1e-3
    assert [t for t, _ in one] == [t for t, _ in one_again]  # prefix hits change no token
    assert tp_hits > 0
    assert tp_counts == one_counts  # the same drafts were made and accepted, position by position
    return tp_counts


def test_ngram_tp2_on_llama(tmp_path):
    path = make_dense_checkpoint(tmp_path / "llama", "llama")
    phrase = [31, 32, 33, 34]
    prompts = [phrase * 5 + [7, 8], list(range(10, 44)), [77] * 17]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    drafts, _, accepted, _ = compare_tp2(path, prompts, spec)
    assert drafts > 0 and accepted > 0  # verification accepted drafts on both ranks alike


def test_mtp_tp2_on_deepseek_v3(tmp_path):
    path = make_v3(tmp_path, "tiny", overrides={"num_nextn_predict_layers": 1})
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, 256, (n,), generator=g).tolist() for n in (3, 17, 40)]
    prompts[2][:16] = prompts[1][:16]  # a shared block
    drafts, draft_tokens, _, _ = compare_tp2(path, prompts, {"method": "mtp", "num_speculative_tokens": 2})
    assert draft_tokens > drafts  # chains of k = 2 ran through the sharded MTP layer on both ranks
