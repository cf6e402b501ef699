"""Confidence-scheduled verification (DeepInfer's ``MTPVarlen::schedule``, csrc/engine/mtp_varlen.hpp, with
``DEEPINFER_ENABLE_MTP_VARLEN``): the DSpark confidence head predicts, per draft, the probability that the target
accepts it given the drafts before it were accepted; their running product c_{r,j} is the predicted probability
that draft j of request r is emitted. A step over n requests that verifies m drafts costs a forward of n + m
tokens and is expected to emit n + (the m verified drafts' c summed) tokens. DeepInfer:

1. ranks every (request, draft) by c, highest first (ties: the earlier request),
2. picks the number of verified tokens total_q = n + m that maximises expected tokens / step time over the
   prefixes of that ranking (strictly better only, so the smallest such total),
3. gives each request 1 + (its drafts among the first m) query tokens - a prefix of its drafts, as c only falls
   along a request's drafts.

DeepInfer reads the step time off a measured CUDA-graph curve (forward ms per graph size, plus a fitted slope and
the sampler's time). openinfer models it as ``1 + token_cost * total_q`` (``speculative_config.
confidence_token_cost``: one more verified token's cost relative to a step's fixed cost), which is the curve's
shape on a CPU, where a forward's time grows with its tokens from the first one. Cost 0 verifies every draft with
c > 0; a large cost verifies only the surest ones.
"""
from __future__ import annotations


def cumulative(confidence: list[float]) -> list[float]:
    """Per-draft rates -> the predicted probability each draft is emitted (DeepInfer multiplies them up)."""
    out, acc = [], 1.0
    for c in confidence:
        acc *= c
        out.append(acc)
    return out


def drafts_to_verify(rates: list[list[float]], token_cost: float) -> list[int]:
    """Per request its drafts' confidences (as the head predicts them; [] for none) -> how many of its drafts
    to verify next step."""
    return distribute(rates, extra_tokens(rates, token_cost))


def _ranked(rates: list[list[float]]) -> list[tuple[float, int]]:
    return sorted(((c, i) for i, r in enumerate(rates) for c in cumulative(r)), key=lambda x: (-x[0], x[1]))


def extra_tokens(rates: list[list[float]], token_cost: float) -> int:
    """Step 2: m, the drafts verified in all (total_q - n)."""
    n = len(rates)
    expected, total = float(n), n
    best, best_total = expected / (1.0 + token_cost * total), total
    for c, _ in _ranked(rates):
        expected += c
        total += 1
        throughput = expected / (1.0 + token_cost * total)
        if throughput > best:
            best, best_total = throughput, total
    return best_total - n


def distribute(rates: list[list[float]], extra: int) -> list[int]:
    """Step 3: each request's share of the ``extra`` verified drafts."""
    counts = [0] * len(rates)
    for _, i in _ranked(rates)[:extra]:
        counts[i] += 1
    return counts
