"""CPU kernel entry points for mHC (hc.py); each returns None when the kernel cannot run (non-CPU tensors,
``OPENINFER_CPU_KERNELS=0``, a failed build, inputs that need gradients), and the caller keeps its torch
path."""
from __future__ import annotations

import torch

from openinfer.layers import cpu_ops


def hc_activate(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, X: torch.Tensor, eps: float,
                iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``HyperConnection._activate`` in one C++ pass: mixes [T, (2+n)n] fp32, X [T, n, D] ->
    (x_in [T, D] in X's dtype, post [T, n] fp32, comb [T, n, n] fp32)."""
    if X.device.type != "cpu" or mixes.device.type != "cpu" or X.dtype not in _DTYPES:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (mixes, base, scale, X)):
        return None  # the op has no backward; autograd callers (training-style tests) keep the torch path
    ops = cpu_ops.get_ops()
    if ops is None:
        return None
    return ops.hc_activate(mixes.contiguous(), base, scale, X.contiguous(), float(eps), int(iters))


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
