"""Speculative decoding across ranks (gloo on 127.0.0.1, the mp executor). Tensor parallel: every rank verifies
the scheduler's drafts against the same all-gathered logits, and MTP's layer runs on every rank over its
TP-sharded weights. Data parallel + expert parallel: each replica drafts and verifies its own requests, and the
replicas - with different accepted lengths, nothing to draft, or no work at all - pad the MTP layer's forwards with
dummies so they meet in the same MoE all-to-alls. Greedy tokens identical to one process with the same proposer -
and the drafting identical too (same drafts, same accepted counts per position) - through chunked prefill and
prefix hits, with every block back in the pool."""
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


TP2 = {"tensor_parallel_size": 2}
DP2_EP = {"data_parallel_size": 2, "enable_expert_parallel": True}


def compare(path: Path, prompts, spec: dict, layout: dict = TP2, **extra) -> tuple:
    """One process and ``layout`` with the same proposer, twice each (the second pass hits the prefix cache); under
    data parallel a third pass of one request leaves the other replica idle throughout."""
    kw = dict(dtype="float32", kv_cache_memory_gb=0.02, max_num_batched_tokens=16, speculative_config=spec, **extra)
    results = []
    for lay in ({}, layout):
        llm = LLM(str(path), **kw, **lay)
        first, again = run(llm, prompts), run(llm, prompts)
        alone = run(llm, prompts[1:2])
        stats = llm.engine.stats()
        results.append((first, again + alone, spec_counts(llm), stats.prefix_cache_hits,
                        stats.spec_decode.confidence_per_pos))
        assert all(kv.all_free() for kv in llm.engine.core.kvs)
        llm.engine.shutdown()
    (one, one_again, one_counts, _, one_conf), (tp, tp_again, tp_counts, tp_hits, tp_conf) = results
    for a, b in zip(one + one_again, tp + tp_again):
        assert a[0] == b[0]
        assert max(abs(x - y) for x, y in zip(a[1], b[1])) < 1e-3
    assert [t for t, _ in one] == [t for t, _ in one_again[:len(one)]]  # prefix hits change no token
    assert tp_hits > 0
    assert tp_counts == one_counts  # the same drafts were made and accepted, position by position
    # DSpark's confidence head: its predictions summed per position, a function of each draft's inputs
    assert len(tp_conf) == len(one_conf) and all(abs(a - b) < 1e-3 for a, b in zip(tp_conf, one_conf))
    return tp_counts


def test_ngram_tp2_on_llama(tmp_path):
    path = make_dense_checkpoint(tmp_path / "llama", "llama")
    phrase = [31, 32, 33, 34]
    prompts = [phrase * 5 + [7, 8], list(range(10, 44)), [77] * 17]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    drafts, _, accepted, _ = compare(path, prompts, spec)
    assert drafts > 0 and accepted > 0  # verification accepted drafts on both ranks alike


def test_mtp_tp2_on_deepseek_v3(tmp_path):
    path = make_v3(tmp_path, "tiny", overrides={"num_nextn_predict_layers": 1})
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, 256, (n,), generator=g).tolist() for n in (3, 17, 40)]
    prompts[2][:16] = prompts[1][:16]  # a shared block
    drafts, draft_tokens, _, _ = compare(path, prompts, {"method": "mtp", "num_speculative_tokens": 2})
    assert draft_tokens > drafts  # chains of k = 2 ran through the sharded MTP layer on both ranks


@pytest.fixture(scope="module")
def v3_mtp(tmp_path_factory):
    return make_v3(tmp_path_factory.mktemp("v3-dp"), "tiny", overrides={"num_nextn_predict_layers": 1})


def v3_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, 256, (n,), generator=g).tolist() for n in (3, 17, 40)]
    prompts[2][:16] = prompts[1][:16]  # a shared block
    return prompts


def test_mtp_k2_dp2_ep_on_deepseek_v3(v3_mtp):
    """MTP k = 2 over two expert-parallel replicas: the MTP layer (an MoE layer) meets the other replica's in every
    all-to-all, real or dummy, while one replica prefills, drafts or idles."""
    drafts, draft_tokens, _, _ = compare(v3_mtp, v3_prompts(), {"method": "mtp", "num_speculative_tokens": 2},
                                         DP2_EP)
    assert draft_tokens > drafts


def test_ngram_dp2_ep_on_deepseek_v3(v3_mtp):
    """Prompt lookup over two expert-parallel replicas: drafts are accepted in different numbers on each replica,
    so the target's steps carry different token counts into the all-to-alls."""
    phrase = [31, 32, 33, 34]
    prompts = [phrase * 5 + [7, 8], v3_prompts()[1], [77] * 17, v3_prompts()[2]]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    drafts, _, accepted, per_pos = compare(v3_mtp, prompts, spec, DP2_EP)
    assert drafts > 0 and accepted > 0


def test_mtp_k2_dp2_ep_on_deepseek_v4(tmp_path):
    """V4's MTP block (loaded with the target, hash-routed and scored MoE layers) pads the same way."""
    from test_deepseek_v4 import _generator, _prompts, write_release_with_mtp

    hf_style = _generator().make_checkpoint(tmp_path / "tiny", "tiny", seed=0)
    write_release_with_mtp(hf_style, tmp_path / "release")
    prompts = [p[:len(p) // 2] * 2 + p for p in _prompts(1, [3, 17, 33])]
    drafts, draft_tokens, _, _ = compare(tmp_path / "release", prompts, {"method": "mtp", "num_speculative_tokens": 2},
                                         DP2_EP, tokenizer=str(hf_style), max_model_len=256)
    assert draft_tokens > drafts


def test_dspark_k2_dp2_ep_on_deepseek_v41(tmp_path):
    """V4.1's MTP is DSpark: one block forward drafts all k, through every draft block's MoE, whose experts are split
    over the replicas too. A replica with nothing to draft (a prompt's non-final 16-token chunk, no request at all)
    runs that block forward as a dummy, so the replicas meet in the same all-to-alls."""
    from helpers import load_script
    from test_deepseek_v41 import _prompts

    path = load_script("make_deepseek_v41_checkpoint").make_checkpoint(tmp_path / "v41", "tiny", seed=0,
                                                                        quantize=False)
    prompts = _prompts(1, [3, 17, 40])
    prompts[2][:16] = prompts[1][:16]  # two shared blocks of 8
    drafts, draft_tokens, _, _ = compare(path, prompts, {"method": "mtp", "num_speculative_tokens": 2}, DP2_EP,
                                         block_size=8, max_model_len=128)
    assert draft_tokens > drafts  # blocks of k = 2 drafts (their confidence sums as one process: compare)
