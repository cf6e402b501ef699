"""Counters of one engine's KV transfers (what /metrics shows per instance). Pure Python."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVTransferStats:
    loads_ok: int = 0  # prompts whose KV was read from a remote instance
    load_failures: int = 0  # reads that failed or timed out
    fallbacks: int = 0  # requests that computed their prompt here after all (a failed read, unusable params)
    bytes_received: int = 0
    seconds_receiving: float = 0.0
    sends_ok: int = 0  # held prompts a remote reader said it finished with
    sends_expired: int = 0  # held prompts freed by the abort timeout

    def snapshot(self) -> KVTransferStats:
        return KVTransferStats(**vars(self))
