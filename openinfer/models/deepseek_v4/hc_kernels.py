"""CPU kernel entry points for mHC (hc.py, kernels in layers/cpu_kernels/hyper_connection.cpp). Each returns
None when its kernel cannot run (non-CPU tensors, ``OPENINFER_CPU_KERNELS=0``, a failed build, inputs that
need gradients) and the caller keeps its torch path."""
from __future__ import annotations

import torch

from openinfer.layers import cpu_ops

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ops(*tensors: torch.Tensor):
    if tensors[-1].dtype not in _DTYPES:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None  # the ops have no backward
    return cpu_ops.ops_for(*tensors)


def hc_activate(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, X: torch.Tensor, eps: float,
                iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``HyperConnection._activate``: mixes [T, (2+n)n] fp32, X [T, n, D] -> (x_in [T, D] in X's dtype,
    post [T, n] fp32, comb [T, n, n] fp32)."""
    ops = _ops(mixes, base, scale, X)
    if ops is None:
        return None
    return ops.hc_activate(mixes.contiguous(), base, scale, X.contiguous(), float(eps), int(iters))


def hc_post_pre(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                base: torch.Tensor, scale: torch.Tensor, norm_eps: float, eps: float,
                iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``hc.fused_post_pre``: y [T, D], X [T, n, D] (one dtype), post [T, n] and comb [T, n, n] fp32 of the
    finished sub-layer, fn / base / scale of the next -> (new X, x_in, post, comb)."""
    ops = _ops(y, post, comb, fn, base, scale, X)
    if ops is None:
        return None
    return ops.hc_post_pre(y.contiguous(), X.contiguous(), post.contiguous(), comb.contiguous(), fn, base,
                           scale, float(norm_eps), float(eps), int(iters))
