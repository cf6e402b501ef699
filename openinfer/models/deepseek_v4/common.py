"""Small building blocks shared by the V4 modules: norms and a linear layer that skips random init."""
from __future__ import annotations

import torch
from torch import nn

# nn.Linear without the kaiming init (every weight comes from the checkpoint); shared with the MoE layers.
from openinfer.layers.deepseek_moe import CheckpointLinear as Linear


class V4RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight (V4 keeps norm weights in fp32), multiplied in fp32 and cast once, like HF."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def fp32_param(*shape: int) -> nn.Parameter:
    """Parameters V4 keeps in fp32 whatever the model dtype (mHC, sinks, ape, gate bias: spec §4.8)."""
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)
