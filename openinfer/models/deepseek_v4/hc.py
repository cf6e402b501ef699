"""Manifold-constrained hyper-connections (mHC, spec §4.2): hc_mult residual streams mixed around each sub-layer.

Per sub-layer, from the streams X [T, n, D] (fp32 maths, like HF):
  m = RMSNorm_noweight(X.flatten) @ fn.T  -> split [pre n | post n | comb n*n]
  pre = sigmoid(.) + eps; post = 2 sigmoid(.); comb = Sinkhorn(softmax(.) + eps)  (doubly stochastic)
  x_in = sum_j pre_j X_j                       (sub-layer input)
  X' = post_k * y + sum_j comb[j, k] X_j       (note the transpose: comb is consumed as comb^T @ X)
``fused_post_pre`` does X' of one sub-layer and the mixes of the next in one pass with the norm applied after the
GEMM (the DeepGEMM "prenorm GEMM" form), so the flattened streams are read once; it is tested against
``hc_post`` followed by ``HyperConnection.forward``.
On CPU, ``_activate`` and ``fused_post_pre`` run as C++ kernels (``hc_kernels``: one pass per token instead of
~100 tiny torch ops per sub-layer); the torch code here is their fallback and the reference they are tested
against (tests/test_hc_kernels.py).
"""
from __future__ import annotations

import torch
from torch import nn

from openinfer.models.deepseek_v4 import hc_kernels
from openinfer.models.deepseek_v4.common import fp32_param


def sinkhorn(comb_logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[.., n, n] logits -> doubly-stochastic matrix: row softmax + eps, column normalise, then iters-1
    alternating row/column normalisations (HF / TileKernels ``sinkhorn_normalize_ref``)."""
    comb = torch.softmax(comb_logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_mult = hc_mult
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        n = hc_mult
        self.fn = fp32_param((2 + n) * n, n * hidden_size)
        self.base = fp32_param((2 + n) * n)
        self.scale = fp32_param(3)

    def _activate(self, mixes: torch.Tensor, X: torch.Tensor):
        # On CPU one C++ pass replaces the ~100 tiny ops below (Sinkhorn is 4 ops per iteration on [T, n, n]),
        # which dominated a decode step; same maths in the same fp32 order.
        out = hc_kernels.hc_activate(mixes, self.base, self.scale, X, self.hc_eps, self.sinkhorn_iters)
        if out is not None:
            return out
        return self._activate_torch(mixes, X)

    def split_mixes(self, mixes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The normed projection [T, (2+n)n] -> (pre [T, n], post [T, n], comb [T, n, n]), all fp32."""
        n = self.hc_mult
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = sinkhorn((comb_w * comb_s).view(-1, n, n) + comb_b.view(n, n), self.sinkhorn_iters, self.hc_eps)
        return pre, post, comb

    def _activate_torch(self, mixes: torch.Tensor, X: torch.Tensor):
        pre, post, comb = self.split_mixes(mixes)
        x_in = (pre.unsqueeze(-1) * X).sum(dim=1).to(X.dtype)
        return x_in, post, comb

    def forward(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """X [T, n, D] -> (x_in [T, D], post [T, n] fp32, comb [T, n, n] fp32)."""
        flat = X.reshape(X.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        return self._activate(flat @ self.fn.t(), X)


def hc_post(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new[k] = post_k * y + sum_j comb[j, k] * X[j]; y [T, D], X [T, n, D]."""
    dtype = X.dtype
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), X)


def fused_post_pre(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                   nxt: HyperConnection) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_post of the finished sub-layer and the next sub-layer's mixes in one pass.
    Returns (new streams, next x_in, next post, next comb)."""
    # On CPU one C++ pass per token; the torch path below makes ~8 full passes over the streams (a third of
    # a long prefill's time went there).
    out = hc_kernels.hc_post_pre(y, X, post, comb, nxt.fn, nxt.base, nxt.scale, nxt.norm_eps, nxt.hc_eps,
                                 nxt.sinkhorn_iters)
    if out is not None:
        return out
    return fused_post_pre_torch(y, X, post, comb, nxt)


def fused_post_pre_torch(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                         nxt: HyperConnection) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = X.dtype
    new = torch.baddbmm(post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2), comb.to(dtype).transpose(-1, -2), X)
    flat = new.reshape(new.shape[0], -1).float()
    # Prenorm GEMM: RMSNorm is a per-row scalar, so it commutes with the projection and is applied to the
    # 24-wide result instead of the n*D-wide input.
    inv_rms = torch.rsqrt(flat.square().mean(-1, keepdim=True) + nxt.norm_eps)
    x_in, p, c = nxt._activate_torch((flat @ nxt.fn.t()) * inv_rms, new)
    return new, x_in, p, c


class HyperHead(nn.Module):
    """Final collapse of the streams before the model norm: sigmoid-weighted sum (no post / comb)."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.hc_fn = fp32_param(hc_mult, hc_mult * hidden_size)
        self.hc_base = fp32_param(hc_mult)
        self.hc_scale = fp32_param(1)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        flat = X.reshape(X.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        pre = torch.sigmoid((flat @ self.hc_fn.t()) * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * X).sum(dim=1).to(X.dtype)
