from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.layers import cpu_ops


class SiluAndMul(nn.Module):
    """SwiGLU on a fused gate|up projection: silu(x[:, :d]) * x[:, d:]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_ops.silu_and_mul(x)  # one pass on CPU (cpu_kernels/layer_ops.cpp)
        if out is not None:
            return out
        d = x.shape[-1] // 2
        # In place on silu's fresh output: one activation-sized buffer fewer per MLP.
        return F.silu(x[..., :d]).mul_(x[..., d:])
