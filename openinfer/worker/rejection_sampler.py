"""Verifying speculative drafts: exact for greedy, distribution-preserving when sampling (Leviathan et al. 2023,
Chen et al. 2023).

The target's logits at the last known token and at each draft give k + 1 distributions p_0..p_k (each with the
request's penalties, temperature, top-k / top-p / min-p, its output history extended by the drafts before it).
Greedy: drafts are accepted while they equal the target's argmax; the first mismatch (or, when all match, the
argmax after the last draft) is the step's last token - the tokens plain greedy decoding would produce. Sampling:
draft d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)), q_j the proposer's distribution (one-hot at
d_j for deterministic proposers such as n-gram); the first rejection draws from the residual max(p_j - q_j, 0)
and ends the step; with every draft accepted a bonus token is drawn from p_k. The emitted tokens are then
distributed exactly as plain sampling's. A request with a seed draws from its own generators, per output position.
"""
from __future__ import annotations

import torch

from openinfer.sampling_params import SamplingParams
from openinfer.worker.sampler import SamplingRow, adjust_logits, sampling_probs, seeded_generator


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams, prompt_token_ids: list[int],
           output_token_ids: list[int], generator: torch.Generator | None,
           draft_probs: torch.Tensor | None = None, allowed_masks: torch.Tensor | None = None,
           ) -> tuple[list[int], torch.Tensor | None]:
    """logits [k+1, V] (raw, at the last known token and at each of the k drafts) -> (the step's tokens: the
    accepted drafts and one more, raw logprobs [k+1, V] when the request asked for logprobs). ``allowed_masks``
    (bool [k+1, V]): structured outputs' grammar at each position; a forbidden draft has p = 0 and is rejected."""
    k = len(drafts)
    rows = [SamplingRow(params, prompt_token_ids, output_token_ids + drafts[:j],
                        None if allowed_masks is None else allowed_masks[j]) for j in range(k + 1)]
    adjusted, raw_lp = adjust_logits(logits, rows)
    if params.greedy:
        targets = adjusted.max(dim=-1).indices.tolist()  # first maximum, as the plain sampler picks
        a = 0
        while a < k and drafts[a] == targets[a]:
            a += 1
        return targets[:a + 1], raw_lp
    probs = sampling_probs(adjusted, rows)
    dev = probs.device
    pos = len(output_token_ids)
    out: list[int] = []
    for j, d in enumerate(drafts):
        p = probs[j]
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        coin = _uniform(params, pos + j, generator, dev)
        if q_d > 0 and coin < min(1.0, float(p[d]) / q_d):
            out.append(d)
            continue
        residual = p.clone()
        if draft_probs is None:
            residual[d] = 0.0
        else:
            residual = (residual - draft_probs[j].to(residual.dtype)).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q: any token of p is a draw from p
            residual = p
        out.append(_draw(residual / residual.sum(), params, pos + j, generator))
        return out, raw_lp
    out.append(_draw(probs[k], params, pos + k, generator))
    return out, raw_lp


def _uniform(params: SamplingParams, position: int, generator: torch.Generator | None, dev: torch.device) -> float:
    g = seeded_generator(params.seed, position, dev, stream=1) if params.seed is not None else generator
    return float(torch.rand((), device=dev, generator=g))


def _draw(probs: torch.Tensor, params: SamplingParams, position: int, generator: torch.Generator | None) -> int:
    """One token from ``probs`` by the exponential race the plain sampler uses (argmax p / Exp(1))."""
    g = seeded_generator(params.seed, position, probs.device) if params.seed is not None else generator
    q = torch.empty_like(probs).exponential_(generator=g)
    return int((probs / q).argmax())
