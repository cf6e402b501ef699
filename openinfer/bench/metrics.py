"""Statistics shared by the benchmarks: vLLM's percentile naming and mean/median/std/pNN summaries."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def p_word(p: float) -> str:
    """vLLM's key spelling: 99 -> '99', 99.9 -> '99.9'."""
    return str(int(p)) if int(p) == p else str(p)


def parse_percentiles(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        p = float(part)
        if not 0 < p < 100:
            raise ValueError(f"percentile {part!r} must be in (0, 100)")
        out.append(p)
    if not out:
        raise ValueError("no percentiles given")
    return out


def summarize_ms(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean / median / std / pNN of ``values_s`` (seconds), in milliseconds. Empty input gives zeros, as in
    vLLM (``np.mean(x or 0)``). Percentiles interpolate linearly between samples (numpy's default)."""
    arr = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        out[f"p{p_word(p)}"] = float(np.percentile(arr, p))
    return out


def peak_per_second(event_times_s: Sequence[float], origin_s: float) -> float:
    """The largest number of events in any 1-second bucket counted from ``origin_s``."""
    if not len(event_times_s):
        return 0.0
    buckets = np.floor(np.asarray(event_times_s) - origin_s).astype(np.int64)
    buckets = buckets[buckets >= 0]
    return float(np.bincount(buckets).max()) if buckets.size else 0.0


def peak_concurrency_per_second(intervals_s: Sequence[tuple[float, float]], origin_s: float) -> int:
    """vLLM's ``max_concurrent_requests``: the most requests active at some point within one 1-second bucket
    (a request counts in every bucket from its start second to its end second)."""
    if not len(intervals_s):
        return 0
    last = max(int(e - origin_s) for _, e in intervals_s)
    counts = np.zeros(last + 2, dtype=np.int64)
    for s, e in intervals_s:
        counts[max(int(s - origin_s), 0)] += 1
        counts[int(e - origin_s) + 1] -= 1
    return int(np.cumsum(counts).max())
