"""RMSNorm, once for every model.

HF's formulas: normalise in fp32, then multiply by the weight in the weight's dtype and cast to the input's.
With the weight in the model dtype (Llama, Qwen, DeepSeek-V3) that is ``weight * normed.to(x.dtype)``; with an fp32
weight (DeepSeek-V4 keeps norm weights in fp32) the product stays fp32 and is cast once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.layers import cpu_ops


class RMSNorm(nn.Module):
    """``forward(x, residual)`` also does the residual add first and returns ``(normed, new_residual)``, the fused
    form every pre-norm decoder layer uses."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=weight_dtype))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # The fp32 part as one fused op instead of five (fp32 x * rsqrt(mean(x^2) + eps)): same values, fewer
        # passes over prefill-sized activations.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        w = self.weight
        return (w * normed.to(w.dtype)).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With a residual this may reuse x's and residual's storage for its two results (on CPU the fused kernel
        works in place): callers pass activations they do not read again, as decoder layers do."""
        if residual is None:
            out = cpu_ops.rms_norm(x, self.weight, self.eps)
            return out if out is not None else self._norm(x)
        if cpu_ops.add_rms_norm_(x, residual, self.weight, self.eps):
            return x, residual
        residual = x + residual
        return self._norm(residual), residual


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, scaled in the input's dtype (DeepSeek-V4's per-head query norm, as HF has it)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
