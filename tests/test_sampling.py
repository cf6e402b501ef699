"""Sampling: filters checked statistically on a known distribution, seeds reproducible across batches,
penalties, stop strings never leaking into text, logprobs, n > 1."""
from __future__ import annotations

import math
import random

import pytest
import torch

from helpers import make_dense_checkpoint
from openinfer import LLM, SamplingParams
from openinfer.worker.sampler import SamplingRow, filter_logits, sample

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])


def draw(params: SamplingParams, n: int = 20000) -> torch.Tensor:
    logits = PROBS.log().repeat(n, 1)
    rows = [SamplingRow(params, [], []) for _ in range(n)]
    g = torch.Generator().manual_seed(0)
    tokens, _ = sample(logits, rows, g)
    return torch.bincount(tokens, minlength=len(PROBS)).float() / n


def expected(mask: list[bool], temperature: float = 1.0) -> torch.Tensor:
    p = PROBS.pow(1 / temperature) * torch.tensor(mask, dtype=torch.float)
    return p / p.sum()


@pytest.mark.parametrize("params, mask", [
    (dict(), [True] * 6),
    (dict(top_k=2), [True, True, False, False, False, False]),
    (dict(top_p=0.5), [True, True, False, False, False, False]),  # 0.4 < 0.5, 0.4+0.25 crosses it
    (dict(top_p=0.75), [True, True, True, False, False, False]),  # 0.65 < 0.75 needs a third token
    (dict(min_p=0.3), [True, True, True, False, False, False]),  # keep p >= 0.3 * 0.4 = 0.12
    (dict(top_k=3, min_p=0.5), [True, True, False, False, False, False]),
])
def test_filters_match_known_distribution(params, mask):
    freq = draw(SamplingParams(temperature=1.0, **params))
    want = expected(mask)
    assert torch.all(freq[~torch.tensor(mask)] == 0), freq
    # 20k draws: binomial std <= 0.0035, so 0.015 is > 4 sigma.
    assert torch.allclose(freq, want, atol=0.015), (freq, want)


def test_temperature_sharpens_as_expected():
    freq = draw(SamplingParams(temperature=0.5))
    assert torch.allclose(freq, expected([True] * 6, 0.5), atol=0.015)


def test_filter_rows_are_independent():
    logits = PROBS.log().repeat(2, 1)
    out = filter_logits(logits, torch.tensor([1, 0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    assert torch.isinf(out[0, 1:]).all() and torch.isfinite(out[1]).all()


def test_penalties_follow_vllm_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    rows = [SamplingRow(SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5,
                                       presence_penalty=0.25), [3], [0, 0, 1])]
    from openinfer.worker.sampler import apply_penalties

    out = apply_penalties(logits.clone(), rows)
    # token 0: 2/2 - 0.5*2 - 0.25; token 1: -1*2 - 0.5 - 0.25; token 2 untouched; token 3 (prompt): 0*2
    assert torch.allclose(out, torch.tensor([[2 / 2 - 1.0 - 0.25, -2.0 - 0.75, 0.5, 0.0]]))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_dense_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", seed=3)
    return LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05, seed=0)


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(6, 256) for _ in range(rng.randrange(4, 40))]} for _ in range(n)]


def test_seeded_sampling_reproducible_across_runs_and_batches(llm):
    target = prompts(1, seed=42)[0]
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([target], sp, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([target], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [(p, SamplingParams(temperature=1.0, max_tokens=int(5 + i), ignore_eos=True))
              for i, p in enumerate(prompts(7, seed=1))]
    batch = others[:3] + [(target, sp)] + others[3:]
    mixed = llm.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)[3].outputs[0].token_ids
    assert alone == again == mixed
    other_seed = llm.generate([target], sp.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_unseeded_sampling_varies(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    p = prompts(1, seed=5)
    a = llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert a != b


def test_stop_strings_never_in_text(llm):
    tok = llm.get_tokenizer()
    base = llm.generate(prompts(6, seed=7), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)
    checked = 0
    for prompt, out in zip(prompts(6, seed=7), base):
        text = out.outputs[0].text
        if len(text) < 8:
            continue
        stop = text[5:7]  # a string the model is known to produce
        res = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
        assert stop not in res.text
        assert res.finish_reason == "stop" and res.stop_reason == stop
        assert text.startswith(res.text) and len(res.text) == text.find(stop)
        kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=True), use_tqdm=False)[0]
        assert kept.outputs[0].text.endswith(stop)
        checked += 1
    assert checked >= 3
    assert tok is not None


def test_stop_token_ids_min_tokens_and_eos(llm):
    p = prompts(1, seed=11)
    free = llm.generate(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free[4]
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[:free.index(stop_at) + 1] and out.stop_reason == stop_at
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=20, min_tokens=20, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 20 and stop_at not in out.token_ids  # banned until min_tokens


def test_logprobs_and_prompt_logprobs(llm):
    p = prompts(2, seed=13)
    outs = llm.generate(p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3,
                                          prompt_logprobs=2), use_tqdm=False)
    for prompt, out in zip(p, outs):
        c = out.outputs[0]
        assert len(c.logprobs) == 5
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert tok in lp and 3 <= len(lp) <= 4
            assert lp[tok] == max(lp.values())  # greedy picks the top logprob
        assert math.isclose(c.cumulative_logprob, sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)),
                            rel_tol=1e-5)
        ids = prompt["prompt_token_ids"]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for tok, lp in zip(ids[1:], out.prompt_logprobs[1:]):
            assert tok in lp and all(v <= 0 for v in lp.values())


def test_prompt_logprobs_survive_chunked_prefill(tmp_path):
    path = make_dense_checkpoint(tmp_path / "m", "llama", seed=3)
    p = prompts(1, seed=17)
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    whole = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02).generate(p, sp, use_tqdm=False)[0]
    chunked = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02, max_num_batched_tokens=8).generate(
        p, sp, use_tqdm=False)[0]
    assert len(whole.prompt_logprobs) == len(chunked.prompt_logprobs)
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)


def test_n_greater_than_one_shares_prompt_blocks(llm):
    p = [{"prompt_token_ids": list(range(10, 60))}]
    out = llm.generate(p, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 3 * 48  # 3 siblings reuse the first's 3 full blocks
    assert stats.num_free_blocks == stats.num_blocks


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4),
                   use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids) == "<|user|>hi</s><|assistant|>"


def test_greedy_argmax_takes_the_first_of_tied_maxima():
    from openinfer.worker.sampler import _argmax

    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, 1.0, 2.0, 2.0]])
    assert _argmax(x).tolist() == [1, 0, 2] == x.argmax(dim=-1).tolist()
    big = torch.randn(64, 32000).round()  # many ties among the maxima
    assert torch.equal(_argmax(big), big.argmax(dim=-1))
