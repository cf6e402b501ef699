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


# ---- fp8_ds_mla: DeepSeek's packed fp8 latent rows (vLLM's kv_cache_dtype "fp8_ds_mla" for DeepSeek-V4) ----------
#
# One row per cached latent of d = nope + rope values: the nope part as e4m3 in tiles of 64 values, each tile with
# its own power-of-two scale (UE8M0: one byte, the exponent + 127; scale = 2^ceil(log2(amax / 448)), amax floored
# at 1e-4), the rope part as bf16 (positions must not lose precision), then the scale bytes padded to a multiple of
# 8. V4-Flash (d 512, rope 64): 448 + 128 + 8 = 584 bytes instead of 1024 in bf16. vLLM's kernels
# (deepseek_v4/common/ops/cache_utils.py) hold the same bytes per entry; in a block they put every row's
# 576 data bytes first and the scales after them, here each row carries its own scales (one row = one slot, which
# the block tables and the C++ kernel index directly).

DS_MLA_TILE = 64


class DsMlaLayout:
    def __init__(self, dim: int, rope_dim: int) -> None:
        if not 0 < rope_dim < dim:
            raise ValueError(f"fp8_ds_mla needs 0 < rope_dim ({rope_dim}) < dim ({dim})")
        self.dim, self.rope, self.nope = dim, rope_dim, dim - rope_dim
        self.tiles = -(-self.nope // DS_MLA_TILE)
        self.scale_bytes = -(-self.tiles // 8) * 8
        self.row_bytes = self.nope + 2 * rope_dim + self.scale_bytes

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] floats -> [..., row_bytes] uint8. A NaN stays NaN (its tile's values become e4m3 NaN)."""
        lead = x.shape[:-1]
        nope = x[..., :self.nope].float()
        pad = self.tiles * DS_MLA_TILE - self.nope
        tiles = torch.nn.functional.pad(nope, (0, pad)).view(*lead, self.tiles, DS_MLA_TILE)
        amax = tiles.abs().amax(dim=-1).clamp(min=1e-4)
        exp = torch.ceil(torch.log2(amax / FP8_MAX))
        exp = torch.where(exp.isfinite(), exp, torch.zeros_like(exp))  # a NaN / inf tile: scale 1, values NaN
        q = (tiles / torch.exp2(exp)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
        scales = torch.zeros(*lead, self.scale_bytes, dtype=torch.uint8, device=x.device)
        scales[..., :self.tiles] = (exp + 127).clamp(0, 255).to(torch.uint8)
        rope = x[..., self.nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
        return torch.cat([q.reshape(*lead, -1)[..., :self.nope], rope, scales], dim=-1)

    def unpack(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., row_bytes] uint8 -> [..., dim] in ``dtype``: only the rows given are widened."""
        nope = rows[..., :self.nope].contiguous().view(FP8_DTYPE).float()
        exp = rows[..., self.nope + 2 * self.rope:][..., :self.tiles].float() - 127
        scale = torch.exp2(exp).repeat_interleave(DS_MLA_TILE, dim=-1)[..., :self.nope]
        rope = rows[..., self.nope:self.nope + 2 * self.rope].contiguous().view(torch.bfloat16)
        return torch.cat([(nope * scale).to(dtype), rope.to(dtype)], dim=-1)


class Fp8RowLayout:
    """kv_cache_dtype fp8 for DeepSeek-V4's indexer keys (as vLLM packs them): d e4m3 values scaled by the row's
    amax / 448, then that scale as fp32 - 132 B per 128-d key instead of 256 in bf16."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.row_bytes = dim + 4

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
        scale = torch.where(amax.isfinite(), amax / FP8_MAX, torch.ones_like(amax))  # NaN rows stay NaN
        q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
        return torch.cat([q, scale.contiguous().view(torch.uint8)], dim=-1)

    def unpack(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        q = rows[..., :self.dim].contiguous().view(FP8_DTYPE).float()
        scale = rows[..., self.dim:].contiguous().view(torch.float32)
        return (q * scale).to(dtype)


class PackedRows:
    """A flat ``[slots, row_bytes]`` uint8 store of packed rows (either layout above, or ``kv_mx.MxFormat``: any
    object with ``dim``, ``row_bytes``, ``pack`` and ``unpack``) that reads and writes like a ``[slots, dim]``
    tensor of ``dtype``: indexing dequantizes the rows picked, writes (``index_copy_``, item assignment) pack."""

    def __init__(self, data: torch.Tensor, layout: DsMlaLayout | Fp8RowLayout, dtype: torch.dtype) -> None:
        self.data, self.layout, self.dtype = data, layout, dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.layout.dim))

    def __getitem__(self, idx) -> torch.Tensor:
        return self.layout.unpack(self.data[idx], self.dtype)

    def __setitem__(self, idx, value: torch.Tensor) -> None:
        self.data[idx] = self.layout.pack(value)

    def index_copy_(self, dim: int, slots: torch.Tensor, rows: torch.Tensor) -> PackedRows:
        if dim != 0:
            raise ValueError("PackedRows.index_copy_ writes whole rows (dim 0)")
        self.data.index_copy_(0, slots, self.layout.pack(rows))
        return self
