"""Speculative verification (worker/rejection_sampler.py) against exact distributions.

A toy target over a 5-token vocabulary: the next token's logits depend on the last token (a Markov chain). A toy
drafter (another chain) proposes k tokens; verification keeps some and samples one more. Repeated until 3 tokens
are out, the emitted sequences must follow the target's own 3-token distribution - with temperature, top-k and
top-p applied - whether the drafter reports its probabilities or drafts deterministically, and with per-request
seeds. A chi-square goodness-of-fit test decides, and the same test rejects the drafter's distribution (so it
has the power to see a wrong sampler)."""
from __future__ import annotations

import itertools

import pytest
import torch
from stats_utils import goodness_of_fit

from openinfer.sampling_params import SamplingParams
from openinfer.worker.rejection_sampler import verify
from openinfer.worker.sampler import SamplingRow, sampling_probs

V = 5
LENGTH = 3
PROMPT = [0]

torch.manual_seed(3)
TARGET = torch.randn(V, V) * 1.5  # TARGET[a]: logits of the token after a
DRAFT = torch.randn(V, V) * 1.5


def target_probs(params: SamplingParams) -> torch.Tensor:
    """[V, V] the distribution the target samples after each token (temperature, top-k, top-p applied)."""
    rows = [SamplingRow(params, PROMPT, []) for _ in range(V)]
    return sampling_probs(TARGET.clone(), rows).double()


def exact_sequences(probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(V), repeat=LENGTH):
        p, last = 1.0, PROMPT[-1]
        for t in seq:
            p *= float(probs[last, t])
            last = t
        out[seq] = p
    return out


def speculate(params: SamplingParams, k: int, report_draft_probs: bool, gen: torch.Generator) -> tuple[int, ...]:
    """One request: draft k, verify, repeat until LENGTH tokens."""
    q = torch.softmax(DRAFT, dim=-1)
    out: list[int] = []
    while len(out) < LENGTH:
        last = (PROMPT + out)[-1]
        drafts, dprobs = [], []
        for _ in range(k):
            if report_draft_probs:
                d = int(torch.multinomial(q[last], 1, generator=gen))
            else:
                d = int(q[last].argmax())  # deterministic drafter: q is one-hot at d
            drafts.append(d)
            dprobs.append(q[last])
            last = d
        ctx = (PROMPT + out)[-1:] + drafts
        logits = TARGET[ctx]  # the target's logits at the last known token and at each draft
        params_gen = None if params.seed is not None else gen
        tokens, _ = verify(logits, drafts, params, PROMPT, list(out), params_gen,
                           torch.stack(dprobs) if report_draft_probs else None)
        assert 1 <= len(tokens) <= k + 1
        assert tokens[:-1] == drafts[:len(tokens) - 1]  # the accepted ones are a prefix of the drafts
        out += tokens
    return tuple(out[:LENGTH])


@pytest.mark.parametrize("report_draft_probs", [True, False], ids=["draft-probs", "deterministic-draft"])
@pytest.mark.parametrize("sampling", [pytest.param(dict(temperature=1.0), id="plain"),  # top-k/top-p: the slower half
                                      pytest.param(dict(temperature=0.8, top_k=3, top_p=0.9), id="topk-topp",
                                                   marks=pytest.mark.slow)])
def test_emitted_tokens_follow_the_target_distribution(report_draft_probs, sampling):
    params = SamplingParams(max_tokens=LENGTH, **sampling)
    gen = torch.Generator().manual_seed(0)
    samples = [speculate(params, 2, report_draft_probs, gen) for _ in range(4000)]
    expected = exact_sequences(target_probs(params))
    assert goodness_of_fit(samples, expected) > 1e-3
    # Power: the drafter's own distribution is rejected by the same test.
    wrong = exact_sequences(torch.softmax(DRAFT, dim=-1).double())
    assert goodness_of_fit(samples, {s: 0.5 * expected[s] + 0.5 * wrong[s] for s in expected}) < 1e-6


@pytest.mark.slow  # statistical: many samples
def test_per_request_seeds_keep_the_distribution_and_repeat():
    params = [SamplingParams(max_tokens=LENGTH, temperature=0.9, top_k=4, seed=s) for s in range(3000)]
    gen = torch.Generator().manual_seed(0)  # the drafter's; the seeded requests never draw from it
    samples = [speculate(p, 3, True, gen) for p in params]
    assert goodness_of_fit(samples, exact_sequences(target_probs(params[0]))) > 1e-3
    # A seeded request's verification draws from its own generators: same drafts, same tokens.
    ctx_logits = TARGET[[0, 2, 4]]
    a = verify(ctx_logits, [2, 4], params[7], PROMPT, [], None)[0]
    assert all(verify(ctx_logits, [2, 4], params[7], PROMPT, [], torch.Generator())[0] == a for _ in range(5))


def test_greedy_accepts_the_argmax_prefix_and_adds_the_next_argmax():
    greedy = SamplingParams(temperature=0.0)
    chain = [0]
    for _ in range(4):
        chain.append(int(TARGET[chain[-1]].argmax()))
    right = chain[1:4]  # what greedy decoding emits after the prompt
    logits = TARGET[[0] + right]
    assert verify(logits, right, greedy, PROMPT, [], None)[0] == chain[1:5]  # all 3 accepted + the bonus
    wrong = [right[0], (right[1] + 1) % V, right[2]]
    assert verify(TARGET[[0] + wrong], wrong, greedy, PROMPT, [], None)[0] == chain[1:3]  # stops at the mismatch
