"""MXFP4 weights (DeepSeek-V4-Flash routed experts, ``expert_dtype: fp4``), dequantised once at load.

Storage (spec §3): ``int8 [N, K/2]``, two E2M1 values per byte, the **low nibble holding the lower-index
element**; plus one UE8M0 scale (``float8_e8m0fnu``, 2^(byte-127)) per 32 consecutive elements of a row,
``[N, K/32]``. A nibble is sign (bit 3) and a 3-bit magnitude index into E2M1_VALUES; ``w = value * scale``.
"""
from __future__ import annotations

import torch

from openinfer.layers.fp8 import E8M0_DTYPE, scale_to_float

MXFP4_BLOCK = 32
# Nibble -> value: 0..7 positive, 8..15 the same magnitudes negated (8 is -0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
PACKED_DTYPES = (torch.int8, torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed [N, K/2] int8/uint8 + scale [N, K/32] (UE8M0 or float) -> [N, K] in ``dtype`` (math in fp32)."""
    if packed.dtype not in PACKED_DTYPES or packed.dim() != 2:
        raise ValueError(f"MXFP4 weights must be 2-D int8/uint8, got {packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    want = (n, -(-k // MXFP4_BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale has shape {tuple(scale.shape)}; a packed [{n}, {k // 2}] MXFP4 weight "
                         f"({k} values per row, blocks of {MXFP4_BLOCK}) needs {want}")
    b = packed.view(torch.uint8).long()
    nibbles = torch.stack([b & 0xF, b >> 4], dim=-1).view(n, k)  # low nibble first
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)[nibbles]
    return (values * scale_to_float(scale).repeat_interleave(MXFP4_BLOCK, 1)[:, :k]).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for checkpoint generators and tests: a power-of-two scale per 32 values (the smallest that
    keeps the block's amax <= 6), each value rounded to the nearest E2M1 magnitude. K must be even."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"MXFP4 packs two values per byte; K={k} is odd")
    blocks = -(-k // MXFP4_BLOCK)
    padded = torch.zeros(n, blocks * MXFP4_BLOCK, dtype=torch.float32)
    padded[:, :k] = weight.float()
    amax = padded.view(n, blocks, MXFP4_BLOCK).abs().amax(dim=-1).clamp(min=2.0 ** -120)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E2M1_MAX)))
    x = weight.float() / scale.repeat_interleave(MXFP4_BLOCK, 1)[:, :k]
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    index = (x.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # ties -> the smaller magnitude
    nibbles = index | ((x < 0) & (index > 0)).long() << 3
    pairs = nibbles.view(n, k // 2, 2)
    packed = (pairs[..., 0] | pairs[..., 1] << 4).to(torch.uint8).view(torch.int8)
    return packed, scale.to(E8M0_DTYPE)
