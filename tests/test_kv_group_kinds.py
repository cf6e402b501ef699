"""A model with a kind of KV cache the engine was never told about - two sliding windows of different sizes plus
full attention, three groups (tests/toy_sliding_model.py) - runs through the engine unchanged: greedy tokens
equal a dense reference forward through chunked prefill, prefix-cache hits and forced preemption, each sliding
group holds only its window's blocks, and every block comes back."""
from __future__ import annotations

import random

import pytest
import torch
from helpers import engine_model, kv_manager

import toy_sliding_model as toy
from openinfer import LLM, SamplingParams
from openinfer.models.registry import register_model

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    register_model(toy.ARCH, "toy_sliding_model", "ToySlidingForCausalLM")
    path = tmp_path_factory.mktemp("toy")
    toy.write_checkpoint(path)
    return path


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(6, 96) for _ in range(21)]
    out = []
    for i, n in enumerate((3, 30, 9, 26, 17, 40, 6, 23)):
        head = shared[:min(n - 1, 21)] if i % 2 else []  # half share a prefix: something to hit
        out.append(head + [rng.randrange(6, 96) for _ in range(n - len(head))])
    return out


def reference(llm: LLM, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy decoding with the dense, cache-free forward of the same loaded weights."""
    model = engine_model(llm)
    ids, lps = list(prompt), []
    for _ in range(NEW_TOKENS):
        lp = torch.log_softmax(model.reference_logits(ids)[-1].float(), -1)
        tok = int(lp.argmax())
        ids.append(tok)
        lps.append(float(lp[tok]))
    return ids[len(prompt):], lps


def run(llm: LLM, ps: list[list[int]]):
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)


def check(llm: LLM, outs, ps) -> None:
    for out, p in zip(outs, ps):
        toks, lps = reference(llm, p)
        got = out.outputs[0]
        assert got.token_ids == toks
        assert max(abs(got.logprobs[i][t] - lps[i]) for i, t in enumerate(toks)) < 1e-4


def test_the_model_declares_three_groups_and_the_engine_sizes_each(ckpt):
    llm = LLM(str(ckpt), dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=16)
    kv = kv_manager(llm)
    assert [(g.name, g.spec.lookback_tokens) for g in kv.groups] == [("window5", 4), ("window11", 10),
                                                                   ("full", None)]
    assert llm.engine.num_kv_blocks["full"] == 64
    # A sliding pool is sized for the running batch (4 seqs x (ceil(lookback/4) + 2) + 16/4, +25%), not 64.
    assert llm.engine.num_kv_blocks["window5"] == -(-(4 * (1 + 2) + 4) * 125 // 100)
    assert llm.engine.num_kv_blocks["window11"] == -(-(4 * (3 + 2) + 4) * 125 // 100)


def test_chunked_prefill_and_prefix_hits_match_the_dense_reference(ckpt):
    llm = LLM(str(ckpt), dtype="float32", block_size=4, num_kv_blocks=160, max_num_batched_tokens=8)
    ps = prompts()
    check(llm, run(llm, ps), ps)
    # The same prompts again: every full block of each prompt is a hit, whose sliding groups still hold the
    # blocks their window reads (released blocks stay cached until evicted).
    again = run(llm, ps)
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 4 * 4 for p in ps]
    check(llm, again, ps)
    assert kv_manager(llm).all_free()


def test_sliding_groups_release_behind_their_windows(ckpt):
    llm = LLM(str(ckpt), dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    eng, kv = llm.engine, kv_manager(llm)
    eng.add_request("long", {"prompt_token_ids": prompts()[5]}, SamplingParams(temperature=0, max_tokens=40,
                                                                              ignore_eos=True))
    held = {g.name: 0 for g in kv.groups}
    while eng.has_unfinished_requests():
        eng.step()
        for g in kv.groups:
            held[g.name] = max(held[g.name], g.num_held("long"))
    # A decoding sequence holds ceil(lookback / 4) + 2 blocks of a sliding group; the prompt's 8-token chunks one
    # more. The full group holds all 20 blocks of 80 tokens.
    assert held["window5"] <= 1 + 2 + 1 and held["window11"] <= 3 + 2 + 1 and held["full"] == 20
    assert kv.all_free()


def test_preemption_recomputes_identically(ckpt):
    llm = LLM(str(ckpt), dtype="float32", block_size=4, num_kv_blocks=20, max_num_batched_tokens=16)
    ps = prompts(1)[4:]
    outs = run(llm, ps)
    assert llm.engine.stats().num_preemptions > 0
    check(llm, outs, ps)
    assert kv_manager(llm).all_free()
