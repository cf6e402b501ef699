"""Llama / Qwen2 / Qwen3 match HF transformers on the same weights, through every scheduling path."""
from __future__ import annotations

import random

import pytest

from helpers import hf_greedy, make_dense_checkpoint
from openinfer import LLM, SamplingParams

NEW_TOKENS = 32
LENGTHS = (3, 17, 40, 5, 64, 9, 33, 100)
ARCHS = [("llama", {}), ("qwen2", {"tie": True}), ("qwen3", {})]


def prompts_for(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(6, 256) for _ in range(24)]
    out = []
    for i, n in enumerate(LENGTHS):
        # Half the prompts share a 24-token prefix so prefix caching has something to find.
        head = shared[:min(n - 1, 24)] if i % 2 else []
        out.append(head + [rng.randrange(6, 256) for _ in range(n - len(head))])
    return out


@pytest.fixture(scope="module", params=ARCHS, ids=[a for a, _ in ARCHS])
def case(request, tmp_path_factory):
    arch, kw = request.param
    path = make_dense_checkpoint(tmp_path_factory.mktemp(arch), arch, **kw)
    prompts = prompts_for(len(arch))
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


def check(outs, ref, tol=1e-3):
    for out, (tokens, lps) in zip(outs, ref):
        got = out.outputs[0]
        assert got.token_ids == tokens
        assert len(got.logprobs) == NEW_TOKENS
        for pos, (tok, lp) in enumerate(zip(tokens, lps)):
            assert abs(got.logprobs[pos][tok] - lp) < tol, (pos, got.logprobs[pos][tok], lp)


def run(llm, prompts):
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def test_one_mixed_batch(case):
    path, prompts, ref = case
    check(run(LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05), prompts), ref)


def test_small_prefill_chunks(case):
    path, prompts, ref = case
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=8, kv_cache_memory_gb=0.05)
    check(run(llm, prompts), ref)


def test_prefix_cache_hits(case):
    path, prompts, ref = case
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05)
    check(run(llm, prompts), ref)
    again = run(llm, prompts)
    check(again, ref)
    assert all(o.num_cached_tokens > 0 for o, p in zip(again, prompts) if len(p) > 16)
    assert llm.engine.stats().prefix_cache_hits > 0


def test_forced_preemption(case):
    path, prompts, ref = case
    # 12 blocks of 16 tokens cannot hold the batch (the longest request alone needs 9 blocks).
    llm = LLM(str(path), dtype="float32", num_kv_blocks=12)
    check(run(llm, prompts), ref)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_blocks


def test_reference_backend_agrees(case):
    path, prompts, ref = case
    llm = LLM(str(path), dtype="float32", attention_backend="reference", max_num_batched_tokens=16,
              kv_cache_memory_gb=0.05)
    check(run(llm, prompts[:4]), ref[:4])


# The one rotary module (layers/rotary.py) serves every scaling a Llama-family checkpoint may carry.
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_rope_scaling_matches_hf(tmp_path, kind):
    arch = "qwen2" if kind == "yarn" else "llama"
    params = {"rope_theta": 10000.0, **ROPE_SCALINGS[kind]}
    path = make_dense_checkpoint(tmp_path / kind, arch, rope_parameters=params)
    prompts = prompts_for(7)[:4]
    ref = hf_greedy(path, prompts, NEW_TOKENS)
    check(run(LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05), prompts), ref)
