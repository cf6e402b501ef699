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


@dataclass
class KVOffloadStats:
    """Counters of the offloading tier (what /metrics shows with medium="DISK"). Tokens, like the prefix cache's."""

    queries: int = 0  # prompt tokens in full blocks past the pool's hit, looked up in the tier
    hits: int = 0  # of them found in the tier (and loaded)
    loads: int = 0  # requests whose prefix was read from the tier
    load_failures: int = 0  # reads that found a stale, corrupt or missing file (the prompt was recomputed)
    load_seconds: float = 0.0  # summed over reads
    bytes_loaded: int = 0
    blocks_stored: int = 0
    bytes_stored: int = 0
    blocks_evicted: int = 0  # LRU evictions to stay within the tier's size
    blocks_invalid: int = 0  # entries dropped as stale or corrupt (at start-up or when read)
    num_blocks: int = 0  # entries now in the tier
    bytes_used: int = 0
    enabled: bool = True  # False once a write failed (the disk is full): the tier turned itself off

    def snapshot(self) -> KVOffloadStats:
        return KVOffloadStats(**vars(self))

    @staticmethod
    def total(parts: list[KVOffloadStats]) -> KVOffloadStats:
        """Data-parallel replicas' counters as one tier's (enabled while every replica's is)."""
        out = parts[0].snapshot()
        for p in parts[1:]:
            for k, v in vars(p).items():
                setattr(out, k, (getattr(out, k) and v) if k == "enabled" else getattr(out, k) + v)
        return out
