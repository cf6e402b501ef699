"""C1 / C2 KV compression (spec §7.1, DeepInfer ``v4_modules/compress.py``): no overlap, no APE.

Entry w of a ratio-m layer covers tokens [w*m, (w+1)*m):
  C1 (m = 1): latent_w = wkv(h_w)                                     (a one-token softmax is 1: no gate)
  C2 (m = 2): latent_w = sum_j softmax_j(wgate(h_j)) * wkv(h_j)        (per channel, fp32, over the 2 tokens)
  entry_w   = RMSNorm(latent_w)   (pre-RoPE: what the indexer's key projection reads)
  stored    = RoPE(entry_w) at position w*m (compress RoPE, trailing rope dims)
Entry w is visible to a query at position t iff w < (t + 1) // m.
"""
from __future__ import annotations

import torch
from torch import nn

from openinfer.layers.linear import CheckpointLinear
from openinfer.layers.norm import RMSNorm


class Compressor(nn.Module):
    def __init__(self, hidden_size: int, dim: int, ratio: int, eps: float) -> None:
        super().__init__()
        if ratio not in (1, 2):
            raise ValueError(f"compress ratio {ratio}: only C1 / C2 compression is supported")
        self.dim = dim
        self.ratio = ratio
        self.kv_proj = CheckpointLinear(hidden_size, dim, bias=False)
        self.gate_proj = CheckpointLinear(hidden_size, dim, bias=False) if ratio == 2 else None
        self.kv_norm = RMSNorm(dim, eps, torch.float32)

    @property
    def row_width(self) -> int:
        return self.dim * (2 if self.gate_proj is not None else 1)

    def rows(self, h: torch.Tensor) -> torch.Tensor:
        """Each token's raw contribution [T, row_width]: [kv | gate] (C2) or kv (C1)."""
        kv = self.kv_proj(h)
        return kv if self.gate_proj is None else torch.cat([kv, self.gate_proj(h)], dim=-1)

    def pool(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [W, m, row_width] of each window's tokens -> pre-RoPE entries [W, dim]."""
        if self.gate_proj is None:
            latent = rows[:, 0]
        else:
            kv, gate = rows.float().split([self.dim, self.dim], dim=-1)
            latent = (kv * gate.softmax(dim=1)).sum(dim=1).to(rows.dtype)
        return self.kv_norm(latent)
