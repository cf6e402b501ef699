"""Speculative-decoding proposers: what drafts the next tokens of each decoding request (config.SpeculativeConfig).
Each exposes ``propose(rows, ...) -> {request id: drafts}``; the model runner verifies them next step
(rejection_sampler.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openinfer.config import SpeculativeConfig


def make_proposer(config: SpeculativeConfig | None):
    """The proposer ``config`` asks for (None without speculative decoding)."""
    if config is None:
        return None
    if config.method == "ngram":
        from openinfer.worker.proposers.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"speculative_config.method={config.method!r} is not available yet")
