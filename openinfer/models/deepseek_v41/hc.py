"""Shifted mHC (spec §7.5, DeepInfer ``HCLayerMixin`` with ``hc_shifted``): the V4 hyper-connection with its
pre mix offset by one sub-layer.

Per sub-layer s, from the streams X_s (after the previous sub-layer's post):
  (pre_s, post_s, comb_s) = mixes(X_s)          (V4's: RMSNorm_noweight(X.flatten) @ fn.T, sigmoid / Sinkhorn)
  x_in = sum_j pre_{s-1, j} X_s[j]              (the *previous* sub-layer's pre; the first uses one-hot stream 0)
  X_{s+1}[k] = post_s[k] * y + sum_j comb_s[j, k] X_s[j]
After the last sub-layer, its own pre collapses the streams (there is no hc_head) before the final norm.
"""
from __future__ import annotations

import torch

from openinfer.models.deepseek_v4.hc import HyperConnection, hc_post

__all__ = ["ShiftedHyperConnection", "apply_pre", "first_pre", "hc_post"]


class ShiftedHyperConnection(HyperConnection):
    """V4's parameters (fn, base, scale) and activations; only which pre is applied differs."""

    def mixes(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """X [T, n, D] -> (pre [T, n], post [T, n], comb [T, n, n]) fp32."""
        flat = X.reshape(X.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        return self.split_mixes(flat @ self.fn.t())


def apply_pre(pre: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """sum_j pre[:, j] X[:, j] -> [T, D] in X's dtype."""
    return (pre.unsqueeze(-1) * X.float()).sum(dim=1).to(X.dtype)


def first_pre(num_tokens: int, hc_mult: int, device: torch.device) -> torch.Tensor:
    """The one-hot pre the first sub-layer applies (reads stream 0, i.e. the embedding)."""
    pre = torch.zeros(num_tokens, hc_mult, dtype=torch.float32, device=device)
    pre[:, 0] = 1.0
    return pre
