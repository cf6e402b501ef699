"""Helpers for copying checkpoint tensors into model parameters (fused shards, shape checks)."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class WeightLoadError(ValueError):
    pass


def copy_into(param: nn.Parameter | torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise WeightLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                              f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


def load_stacked(
    params: dict[str, nn.Parameter],
    name: str,
    tensor: torch.Tensor,
    stacked: list[tuple[str, str, object]],
    offsets: Callable[[str], dict],
) -> str:
    """Copy one checkpoint tensor into its (possibly fused) parameter; returns the parameter name."""
    for src, fused, shard in stacked:
        token = f".{src}."
        if token not in name:
            continue
        pname = name.replace(token, f".{fused}.")
        if pname not in params:
            raise WeightLoadError(f"checkpoint tensor {name!r} has no matching parameter {pname!r}")
        start, size = offsets(fused)[shard]
        param = params[pname]
        if tensor.shape[0] != size or tuple(tensor.shape[1:]) != tuple(param.shape[1:]):
            raise WeightLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                  f"({size}, {', '.join(map(str, param.shape[1:]))})")
        with torch.no_grad():
            param[start:start + size].copy_(tensor)
        return pname
    if name not in params:
        raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model")
    copy_into(params[name], tensor, name)
    return name
