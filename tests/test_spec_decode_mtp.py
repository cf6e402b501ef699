"""DeepSeek-V3 MTP speculative decoding: the MTP layer is read from ``model.layers.{num_hidden_layers}.*``; greedy
output with k = 1, 2, 3 is identical to speculation off and to HF through every scheduling path; the engine's
drafts equal a whole-sequence recompute of the MTP layer (catch-up and chain over the paged cache are right)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers import engine_model, hf_greedy, kv_manager
from openinfer import LLM, SamplingParams
from openinfer.config import AttentionBackend, ModelConfig
from openinfer.forward_context import AttentionMetadata, set_forward_context
from openinfer.layers.attention import FULL_ATTENTION_GROUP
from openinfer.worker.loader import load_mtp_layer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_deepseek_checkpoint import make_v3  # noqa: E402

NEW_TOKENS = 20


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = make_v3(tmp_path_factory.mktemp("v3-mtp"), "tiny", overrides={"num_nextn_predict_layers": 1})
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, 256, (n,), generator=g).tolist() for n in (3, 17, 40, 5, 64, 9)]
    prompts[4][:16] = prompts[1][:16]  # a shared block for prefix caching
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def greedy(llm, prompts):
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("path_kind", ["mixed-batch", "chunked-prefill", "prefix-hits", "preemption"])
def test_greedy_identical_to_hf_with_mtp(v3, k, path_kind):
    path, prompts, ref = v3
    kw = dict(dtype="float32", speculative_config=mtp(k), kv_cache_memory_gb=0.05)
    if path_kind == "chunked-prefill":
        kw["max_num_batched_tokens"] = 16
    if path_kind == "preemption":
        del kw["kv_cache_memory_gb"]
        kw["num_kv_blocks"] = 10
    llm = LLM(str(path), **kw)
    runs = 2 if path_kind == "prefix-hits" else 1
    for _ in range(runs):
        for out, (tokens, lps) in zip(greedy(llm, prompts), ref):
            got = out.outputs[0]
            assert got.token_ids == tokens
            assert max(abs(got.logprobs[i][t] - lp) for i, (t, lp) in enumerate(zip(tokens, lps))) < 1e-3
    stats = llm.engine.stats()
    assert stats.spec_decode.num_drafts > 0
    assert stats.spec_decode.num_draft_tokens > stats.spec_decode.num_drafts or k == 1  # chains of k > 1 ran
    if path_kind == "preemption":
        assert stats.num_preemptions > 0
    if path_kind == "prefix-hits":
        assert stats.prefix_cache_hits > 0
    assert kv_manager(llm).all_free()
    assert any(n.startswith("mtp.") for n in kv_manager(llm).num_blocks)  # the MTP layer's KV is a group


@torch.inference_mode()
def reference_drafts(path: Path, tokens: list[int], k: int) -> list[int]:
    """The MTP layer over the whole sequence with no cache reuse: position p reads the target's final hidden
    state at p (HF) and token p + 1; then each draft goes in after the last position with the layer's own
    output as its hidden state, the whole sequence recomputed every time."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hidden = target.model(torch.tensor([tokens])).last_hidden_state[0]
    mc = ModelConfig.from_path(path, dtype="float32", device="cpu")
    layer = load_mtp_layer(mc, 0, AttentionBackend.REFERENCE, torch.device("cpu"))
    n = len(tokens) - 1 + k
    blocks = -(-n // 16)
    layer.bind_kv_cache({FULL_ATTENTION_GROUP: blocks}, 16, torch.float32, torch.device("cpu"))
    ids, prev, drafts = list(tokens[1:]), hidden[:-1], []
    for _ in range(k):
        md = AttentionMetadata.build([len(ids)], [len(ids)], {FULL_ATTENTION_GROUP: [list(range(blocks))]},
                                     {FULL_ATTENTION_GROUP: 16}, 16, torch.device("cpu"))
        with set_forward_context(md):
            out = layer(torch.tensor(ids), md.positions, prev)
        drafts.append(int(layer.compute_logits(out[-1:]).argmax()))
        ids, prev = ids + [drafts[-1]], torch.cat([prev, out[-1:]])
    return drafts


def record_drafts(proposer) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, the drafts proposed after them) for every draft the proposer makes from now on."""
    seen: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def spy(step):
        out = propose(step)
        seen.extend((list(r.state.token_ids), out[r.state.req_id]) for r in step.sampled if r.state.req_id in out)
        return out

    proposer.propose = spy
    return seen


def test_engine_drafts_equal_a_whole_sequence_recompute(v3):
    path, prompts, _ = v3
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05, max_num_batched_tokens=16,
              speculative_config=mtp(3))
    proposer = llm.engine.core.executor.driver_worker.model_runner.proposer
    seen = record_drafts(proposer)
    greedy(llm, prompts[:4])
    assert len(seen) > 20
    for tokens, drafts in seen[::7]:  # after prefills, chunked prefills and verified steps alike
        assert drafts == reference_drafts(path, tokens, 3)[:len(drafts)], len(tokens)
    assert engine_model(llm) is not proposer.module  # the MTP layer is its own module beside the target


def test_drafts_after_a_prompt_chunked_alone(v3):
    """A prompt alone in the engine, split into chunks: the steps of its first chunks sample nothing, and the MTP
    layer must still run over them (its KV for those positions), or its first drafts read empty rows."""
    path, prompts, _ = v3
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05, max_num_batched_tokens=16,
              speculative_config=mtp(2))
    proposer = llm.engine.core.executor.driver_worker.model_runner.proposer
    seen = record_drafts(proposer)
    greedy(llm, [prompts[4]])  # 64 tokens: three chunks that sample nothing, then the fourth
    tokens, drafts = seen[0]
    assert len(tokens) == len(prompts[4]) + 1
    assert drafts == reference_drafts(path, tokens, 2)


def test_mtp_start_up_errors(v3, tmp_path):
    path, _, _ = v3
    from helpers import make_dense_checkpoint

    llama = make_dense_checkpoint(tmp_path / "llama", "llama", num_hidden_layers=1)
    with pytest.raises(ValueError, match="has no MTP layers"):
        LLM(str(llama), speculative_config=mtp(1))
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, 16\]"):
        LLM(str(path), speculative_config=mtp(0))


# -- DeepSeek-V4: the mtp.{i} block loaded with the target ---------------------------------------------------------
@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from test_deepseek_v4 import _generator, _prompts, write_release_with_mtp

    base = tmp_path_factory.mktemp("v4-mtp")
    hf_style = _generator().make_checkpoint(base / "tiny", "tiny", seed=0)
    write_release_with_mtp(hf_style, base / "release")
    prompts = _prompts(1, [3, 17, 33, 40, 52, 64])
    prompts = [p[:len(p) // 2] * 2 + p for p in prompts]  # some repetition: the MTP layer sees varied inputs
    llm = LLM(str(base / "release"), tokenizer=str(hf_style), dtype="float32", max_model_len=256, num_kv_blocks=96)
    return base / "release", hf_style, prompts, greedy(llm, prompts)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("path_kind", ["mixed-batch", "chunked-prefill", "prefix-hits", "preemption"])
def test_v4_greedy_identical_with_mtp(v4, k, path_kind):
    path, tok, prompts, ref = v4
    kw = dict(dtype="float32", max_model_len=256, speculative_config=mtp(k), num_kv_blocks=96)
    if path_kind == "chunked-prefill":
        kw["max_num_batched_tokens"] = 8
    if path_kind == "preemption":
        kw.update(num_kv_blocks=12, max_num_batched_tokens=64)  # the longest prompts alone need 8 blocks each
    llm = LLM(str(path), tokenizer=str(tok), **kw)
    for _ in range(2 if path_kind == "prefix-hits" else 1):
        for out, want in zip(greedy(llm, prompts), ref):
            assert out.outputs[0].token_ids == want.outputs[0].token_ids
            assert max(abs(a[t] - b[t]) for a, b, t in zip(out.outputs[0].logprobs, want.outputs[0].logprobs,
                                                           want.outputs[0].token_ids)) < 1e-4
    stats = llm.engine.stats()
    assert stats.spec_decode.num_drafts > 0
    if path_kind == "preemption":
        assert stats.num_preemptions > 0
    if path_kind == "prefix-hits":
        assert stats.prefix_cache_hits > 0
    assert kv_manager(llm).all_free()
    assert any(n.startswith("mtp.") for n in kv_manager(llm).num_blocks)


def test_v4_without_mtp_weights_is_a_start_up_error(v4):
    _, hf_style, _, _ = v4
    with pytest.raises(ValueError, match=r"no MTP layer mtp\.0\.\*"):
        LLM(str(hf_style), dtype="float32", max_model_len=256, num_kv_blocks=96, speculative_config=mtp(1))
