"""Micro-scaled KV rows as DeepInfer stores DeepSeek-V4.1's caches (``tilelang_ops/cache_common.py``): a row of
``dim`` values is quantised in groups of ``per_sf`` with one scale per group, and stored as one record
``[data | scales]`` of ``row_bytes`` uint8 (DeepInfer's token-interleaved record; its index cache keeps the data
and the scales in block-wide sections instead, the same bytes per token).

  MXFP8   e4m3 values, a UE8M0 (power-of-two) scale per 32   512-d: 512 + 16 = 528 B   (V41_FORMAT)
  FP4     e2m1 values, an e4m3 scale per 16                  512-d: 256 + 32 = 288 B   (V41_FP4_FORMAT)
  FP4 idx e2m1 values, a UE8M0 scale per 32                  128-d:  64 +  4 =  68 B   (FP4_INDEX_KV_FORMAT)

The casts follow DeepInfer's reference (``ref_cast_from_bf16`` and the TileKernels casts it calls):
- UE8M0 scale: ``s = max(amax, margin) / qmax`` rounded *up* to a power of two (on its float bits:
  ``(bits + 0x7FFFFF) & 0x7F800000``); values ``x * (1 / s)``. margin 1e-4 for e4m3, 6 * 2^-126 for e2m1.
- e4m3 scale (FP4 main KV): ``s = e4m3(min(max(amax, 6 * 2^-9) * (1 / 6), 448))`` (round to nearest even), values
  ``x * (1 / float(s))`` - the data are quantised by the scale as stored.
- e4m3 values: clamp to +-448, round to nearest even (torch's cast). e2m1 values: round to nearest even on the
  grid 0, 0.5, 1, 1.5, 2, 3, 4, 6, saturating at 6 (a NaN becomes 6 with its sign, as DeepInfer's reference);
  two per byte, the low nibble holding the lower-index value (``layers/mxfp4.py``'s codes).
Reading a row back multiplies the decoded values by their scale in fp32 (exact: at most 7 significant bits).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from openinfer.layers.mxfp4 import E2M1_VALUES

E4M3 = torch.float8_e4m3fn
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_POSITIVE = 2.0 ** -9  # the smallest e4m3 subnormal: an e4m3 scale never rounds to 0
FP8_AMAX_MARGIN = 1e-4
FP4_AMAX_MARGIN = E2M1_MAX * 2.0 ** -126


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> e2m1 nibbles uint8: sign bit 3, magnitude index 0..7;
    round to nearest even in each of the grid's three spacings (0.5 below 2, 1 below 4, 2 up to 6)."""
    mag = torch.nan_to_num(x.abs(), nan=E2M1_MAX, posinf=E2M1_MAX).clamp(max=E2M1_MAX)
    # torch.round rounds halves to even: on the scaled grid the code's parity is the rounded value's.
    code = torch.where(mag < 2, (mag * 2).round(), torch.where(mag < 4, mag.round() + 2, (mag * 0.5).round() + 4))
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 nibbles -> fp32 values."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]


def ue8m0_round_up(amax: torch.Tensor, qmax: float, margin: float) -> torch.Tensor:
    """fp32 power-of-two scale >= max(amax, margin) / qmax, the smallest such (rounded up on the float bits)."""
    s = amax.float().clamp(min=margin) / qmax
    return ((s.view(torch.int32) + 0x007FFFFF) & 0x7F800000).view(torch.float32)


@dataclass(frozen=True)
class MxFormat:
    """One cache record layout (see the module docstring). ``name`` is DeepInfer's word for it."""

    name: str
    dim: int
    fp4: bool  # e2m1 values (else e4m3)
    per_sf: int  # values per scale
    e4m3_scale: bool  # scale as e4m3 (else UE8M0)

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % self.per_sf:
            raise ValueError(f"{self.name} KV needs a row width divisible by {self.per_sf}, got {self.dim}")

    @property
    def data_bytes(self) -> int:
        return self.dim // 2 if self.fp4 else self.dim

    @property
    def num_scales(self) -> int:
        return self.dim // self.per_sf

    @property
    def row_bytes(self) -> int:
        return self.data_bytes + self.num_scales  # every scale is one byte (e4m3 or UE8M0)

    def _scales(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., G, per_sf] fp32 -> (scale as stored, uint8 [..., G]; its fp32 value [..., G])."""
        amax = groups.abs().amax(dim=-1)
        if self.e4m3_scale:
            sf = (amax.clamp(min=E4M3_MIN_POSITIVE * E2M1_MAX) * (1.0 / E2M1_MAX)).clamp(max=E4M3_MAX).to(E4M3)
            return sf.view(torch.uint8), sf.float()
        s = ue8m0_round_up(amax, E2M1_MAX if self.fp4 else E4M3_MAX, FP4_AMAX_MARGIN if self.fp4 else FP8_AMAX_MARGIN)
        return (s.view(torch.int32) >> 23).to(torch.uint8), s

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] floats -> [..., row_bytes] uint8 records."""
        lead = x.shape[:-1]
        groups = x.float().reshape(*lead, self.num_scales, self.per_sf)
        sf_bytes, sf = self._scales(groups)
        q = groups * torch.where(sf == 0, 0.0, 1.0 / sf)[..., None]
        if self.fp4:
            codes = e2m1_codes(q).reshape(*lead, self.dim // 2, 2)
            data = codes[..., 0] | (codes[..., 1] << 4)
        else:
            data = q.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(torch.uint8).reshape(*lead, self.dim)
        return torch.cat([data, sf_bytes], dim=-1)

    def unpack(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., row_bytes] uint8 -> [..., dim] in ``dtype``."""
        lead = rows.shape[:-1]
        data, sf_bytes = rows[..., :self.data_bytes], rows[..., self.data_bytes:]
        if self.fp4:
            values = e2m1_decode(torch.stack([data & 0xF, data >> 4], dim=-1)).reshape(*lead, self.dim)
        else:
            values = data.contiguous().view(E4M3).float()
        if self.e4m3_scale:
            sf = sf_bytes.contiguous().view(E4M3).float()
        else:
            sf = (sf_bytes.to(torch.int32) << 23).view(torch.float32)
        return (values.view(*lead, self.num_scales, self.per_sf) * sf[..., None]).reshape(*lead, self.dim).to(dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What storing ``x`` and reading it back gives, in x's dtype (DeepInfer quantises the indexer's queries so)."""
        return self.unpack(self.pack(x), x.dtype)


def mxfp8(dim: int) -> MxFormat:
    return MxFormat("MXFP8", dim, fp4=False, per_sf=32, e4m3_scale=False)


def fp4_main(dim: int) -> MxFormat:
    return MxFormat("FP4", dim, fp4=True, per_sf=16, e4m3_scale=True)


def fp4_index(dim: int) -> MxFormat:
    return MxFormat("FP4 (UE8M0)", dim, fp4=True, per_sf=32, e4m3_scale=False)
