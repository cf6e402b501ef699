"""Confidence-scheduled verification (engine/confidence_schedule.py) against DeepInfer: the share of each request
equals DeepInfer's own ``compute_seqlens_q_by_confidence_rates_ref`` (loaded as an oracle), and the number of
verified tokens is the throughput-best prefix of the ranking (DeepInfer's MTPVarlen rule, brute-forced here)."""
from __future__ import annotations

import pytest
import torch

from openinfer.config import SpeculativeConfig
from openinfer.engine.confidence_schedule import cumulative, distribute, drafts_to_verify, extra_tokens
from tests import deepinfer_oracles as oracles


@pytest.mark.parametrize("num_seqs,nextn,total_q", [(4, 3, 8), (16, 7, 40), (64, 5, 128), (8, 1, 8), (1, 5, 4),
                                                    (32, 7, 32 * 8)])
def test_share_equals_deepinfer(num_seqs, nextn, total_q):
    ref = oracles.op("schedule_mtp_varlen", "compute_seqlens_q_by_confidence_rates_ref"
                     ).compute_seqlens_q_by_confidence_rates_ref
    g = torch.Generator().manual_seed(num_seqs * 100 + nextn)
    rates = torch.rand(num_seqs, nextn, generator=g) * 0.8 + 0.1
    want = torch.empty(num_seqs, dtype=torch.int32)
    ref(total_q, torch.arange(num_seqs, dtype=torch.int32), rates, want)
    extra = min(total_q - num_seqs, num_seqs * nextn)
    got = distribute(rates.tolist(), extra)
    assert [1 + c for c in got] == want.tolist()


def test_verified_total_is_the_throughput_best_prefix():
    g = torch.Generator().manual_seed(1)
    rates = (torch.rand(6, 4, generator=g) * 0.9 + 0.05).tolist()
    flat = sorted((c for r in rates for c in cumulative(r)), reverse=True)
    for cost in (0.0, 0.02, 0.1, 0.3, 1.0, 10.0):
        through = [(6 + sum(flat[:m])) / (1 + cost * (6 + m)) for m in range(len(flat) + 1)]
        m = max(range(len(through)), key=lambda i: (through[i], -i))  # the first best, as DeepInfer's strict >
        assert extra_tokens(rates, cost) == m
        counts = drafts_to_verify(rates, cost)
        assert sum(counts) == m and all(0 <= c <= 4 for c in counts)
    assert sum(drafts_to_verify(rates, 0.0)) == 24  # free tokens: every draft
    assert drafts_to_verify(rates, 1e6) == [0] * 6  # dear tokens: none


def test_bad_cost_is_a_clear_error():
    for bad in (-0.1, float("inf"), "x", True):
        with pytest.raises(ValueError, match="confidence_token_cost must be a finite number >= 0"):
            SpeculativeConfig("mtp", 2, confidence_token_cost=bad)
    with pytest.raises(ValueError, match="confidence_token_cost needs the DSpark confidence head"):
        SpeculativeConfig("ngram", 2, confidence_token_cost=0.1)
