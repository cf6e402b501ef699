"""Helpers for copying checkpoint tensors into model parameters (shape checks, lazy tensors read on copy)."""
from __future__ import annotations

import torch
from torch import nn

from openinfer.layers.weight_utils import WeightLoadError, materialize  # noqa: F401 (re-exported)


def copy_into(param: nn.Parameter | torch.Tensor, tensor, name: str) -> None:
    """Copy a whole checkpoint tensor (a tensor or a lazy ``CheckpointTensor``) into ``param``, shapes checked."""
    if tuple(param.shape) != tuple(tensor.shape):
        raise WeightLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                              f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(materialize(tensor))
