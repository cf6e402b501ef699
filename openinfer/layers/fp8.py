"""FP8 e4m3 block-quantised weights (DeepSeek-V3 style), dequantised once at load.

DeepSeek ships linear weights as ``float8_e4m3fn [N, K]`` plus ``weight_scale_inv`` fp32
``[ceil(N/bn), ceil(K/bk)]`` (bn = bk = 128): every block of the weight shares one multiplier, and the last
block row/column may be ragged. ``w = fp8 * scale_inv`` per block. We dequantise at load (to the model dtype)
because CPU and most GPUs have no FP8 GEMM we can rely on; an FP8 GEMM path would keep the raw tensors.
"""
from __future__ import annotations

from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)


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
    if qc.get("scale_fmt") not in (None, "fp32", "float32"):
        # UE8M0 scales (V4) are stored in a different dtype; the V4 loader handles those.
        raise ValueError(f"quantization_config.scale_fmt={qc['scale_fmt']!r} is not supported here")
    block = qc.get("weight_block_size") or list(DEFAULT_BLOCK)
    if len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block):
        raise ValueError(f"quantization_config.weight_block_size={block!r} must be two positive ints")
    return int(block[0]), int(block[1])


def _expand_scale(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    n, k = shape
    bn, bk = block
    return scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


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


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse used by checkpoint generators and tests: per-block amax / 448 scales, e4m3 values."""
    n, k = weight.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))
    scale_inv = (amax / FP8_MAX).clamp(min=1e-12)  # all-zero blocks still get a finite scale
    q = (weight.float() / _expand_scale(scale_inv, (n, k), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv
