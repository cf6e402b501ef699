"""Small building blocks shared by the V4 modules."""
from __future__ import annotations

import torch
from torch import nn


def fp32_param(*shape: int) -> nn.Parameter:
    """Parameters V4 keeps in fp32 whatever the model dtype (mHC, sinks, ape, gate bias: spec §4.8)."""
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)
