"""fp8 KV cache (``kv_cache_dtype="fp8"``): what a cache write stores and what a read gives back.

vLLM's semantics: ``fp8`` and ``fp8_e4m3`` store K/V (or an MLA latent) as float8_e4m3fn with a per-tensor scale of
1.0, i.e. the value itself rounded to e4m3 (3 mantissa bits, largest finite value 448; no infinity). The write
clamps first: saturation at +-448 whatever the torch version or device does with out-of-range casts (older
casts gave NaN), while a NaN stays NaN (clamp propagates it) rather than becoming a plausible number. Reads widen e4m3 to the compute dtype
only for the rows they use (the C++ decode kernels convert in registers; the torch paths per gathered block).
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: saturating e4m3 for an fp8 cache, else a plain cast."""
    if cache_dtype == FP8_DTYPE:
        return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x.to(cache_dtype)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """What reading ``x`` back from a cache of ``cache_dtype`` gives, in x's dtype: the attention over a fresh
    prefill chunk uses it, so a chunk computed now and the same chunk read later from the cache (prefix caching,
    chunked prefill, preemption's recompute) see the same keys and values."""
    if cache_dtype == FP8_DTYPE:
        return to_cache(x, cache_dtype).to(x.dtype)
    return x


def write_rows(cache_rows: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """``cache_rows[slots] = to_cache(x)`` for a ``[slots, ...]`` view of a cache. index_copy_ has no float8 kernel
    on CPU: an fp8 cache is written through its bytes (uint8 views of the same storage)."""
    q = to_cache(x, cache_rows.dtype)
    if cache_rows.dtype == FP8_DTYPE:
        cache_rows.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
    else:
        cache_rows.index_copy_(0, slots, q)
