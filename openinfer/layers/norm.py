from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.layers import cpu_ops


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 like HF. ``forward(x, residual)`` also does the residual add first and
    returns ``(normed, new_residual)``, the fused form every decoder layer uses."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # HF's formula (fp32 x * rsqrt(mean(x^2) + eps), cast, then the weight) with the fp32 part in one fused
        # op instead of five: same values, fewer passes over prefill-sized activations.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With a residual this may reuse x's and residual's storage for its two results (on CPU the fused
        kernel works in place): callers pass activations they do not read again, as decoder layers do."""
        if residual is None:
            out = cpu_ops.rms_norm(x, self.weight, self.eps)
            return out if out is not None else self._norm(x)
        if cpu_ops.add_rms_norm_(x, residual, self.weight, self.eps):
            return x, residual
        residual = x + residual
        return self._norm(residual), residual
