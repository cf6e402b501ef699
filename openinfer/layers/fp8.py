"""FP8 e4m3 block-quantised weights (DeepSeek-V3 / V4 style), dequantised once at load.

DeepSeek ships linear weights as ``float8_e4m3fn [N, K]`` plus one multiplier per ``[bn, bk]`` block
(``[ceil(N/bn), ceil(K/bk)]``, bn = bk = 128; the last block row/column may be ragged): ``w = fp8 * scale``.
HF-converted checkpoints call the multiplier ``weight_scale_inv``, DeepSeek's own release ``scale``; it is
fp32 (V3, V4-Flash-Base) or UE8M0 (``scale_fmt: ue8m0``, V4-Flash: ``float8_e8m0fnu`` = 2^(byte-127)).
We dequantise at load (to the model dtype) because CPU and most GPUs have no FP8 GEMM we can rely on; an FP8
GEMM path would keep the raw tensors.
"""
from __future__ import annotations

from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
E8M0_DTYPE = torch.float8_e8m0fnu
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)
SCALE_FORMATS = ("float32", "ue8m0")


def fp8_block_size(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """The weight block size if the checkpoint is FP8 block-quantised, None if it is not quantised.

    Raises ValueError naming the field for quantisation schemes we cannot load."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported (supported: fp8)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r} is not supported (supported: e4m3)")
    if qc.get("scale_fmt") not in (None, "fp32", *SCALE_FORMATS):
        raise ValueError(f"quantization_config.scale_fmt={qc['scale_fmt']!r} is not supported "
                         f"(supported: {', '.join(SCALE_FORMATS)})")
    block = qc.get("weight_block_size") or list(DEFAULT_BLOCK)
    if len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block):
        raise ValueError(f"quantization_config.weight_block_size={block!r} must be two positive ints")
    return int(block[0]), int(block[1])


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A block scale in fp32: float tensors as they are, UE8M0 (``float8_e8m0fnu``) as 2^(byte-127) exactly.
    Integer tensors are rejected: raw exponent bytes and integer multipliers cannot be told apart."""
    if scale.dtype == E8M0_DTYPE or scale.dtype.is_floating_point:
        return scale.float()
    raise ValueError(f"scale dtype {scale.dtype} is not a float or float8_e8m0fnu scale")


def _expand_scale(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    n, k = shape
    bn, bk = block
    return scale_to_float(scale_inv).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] = DEFAULT_BLOCK,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """weight [N, K] fp8 + scale_inv [ceil(N/bn), ceil(K/bk)] -> [N, K] in ``dtype`` (math in fp32)."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block weights must be 2-D, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}; a [{n}, {k}] weight in "
                         f"{bn}x{bk} blocks needs {want}")
    return (weight.float() * _expand_scale(scale_inv, (n, k), block)).to(dtype)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                       scale_fmt: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse used by checkpoint generators and tests: per-block amax / 448 scales, e4m3 values.
    ``scale_fmt="ue8m0"`` rounds each scale up to a power of two and returns it as ``float8_e8m0fnu``."""
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt={scale_fmt!r} is not one of {SCALE_FORMATS}")
    n, k = weight.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))
    scale_inv = (amax / FP8_MAX).clamp(min=1e-12)  # all-zero blocks still get a finite scale
    if scale_fmt == "ue8m0":
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    q = (weight.float() / _expand_scale(scale_inv, (n, k), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv.to(E8M0_DTYPE) if scale_fmt == "ue8m0" else scale_inv
