"""V4.1 lightning indexer (spec §7.2/7.4, DeepInfer ``v4_modules/index_attn.py``) and candidate blocks.

  q^I_t    = RoPE(wq_b(q_residual_t)).view(n_h, d_I)                        (query position)
  K^I_w    = RoPE(k_norm(wk(entry_w)), w*m)   entry_w: the compressor's pre-RoPE entry (no own compressor)
  I[t, w]  = sum_h weights_proj(x_t)_h * n_h^-0.5 * ReLU(q^I_{t,h} . K^I_w) * d_I^-0.5,  w < (t+1)//m
  top-k    = the index_topk highest visible scores; ties -> lowest entry (stable sort), -1 pads
Candidate blocks: the candidate source layer also groups its entries in blocks of ``candidate_block_size`` and
keeps, per query, the ``candidate_topk_blocks`` blocks with the highest max score, the newest visible block always
among them (DeepInfer scores it +inf); later index layers (of the same ratio) only score entries inside those
blocks. The positive scale factors do not change any ranking; they are kept
so scores match V4's indexer.
Layers that are not an index source reuse their source's top-k; layers that are not an index-K source read the
index keys their source stored.
"""
from __future__ import annotations

import torch
from torch import nn

from openinfer.layers.linear import CheckpointLinear
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import apply_interleaved


class Indexer(nn.Module):
    def __init__(self, hidden_size: int, q_lora_rank: int, latent_dim: int, n_heads: int, head_dim: int,
                 owns_keys: bool, eps: float) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.q_b_proj = CheckpointLinear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = CheckpointLinear(hidden_size, n_heads, bias=False)
        # Only index-K sources hold the key projection (the checkpoint has it nowhere else).
        self.wk = CheckpointLinear(latent_dim, head_dim, bias=False) if owns_keys else None
        self.k_norm = RMSNorm(head_dim, eps, torch.float32) if owns_keys else None

    def keys(self, entries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE compressed entries [W, latent] -> index keys [W, d_I] roped at the entries' positions."""
        return apply_interleaved(self.k_norm(self.wk(entries)), cos, sin)

    def query(self, q_residual: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> (q [T, n_h, d_I] roped, head weights [T, n_h] fp32 scaled by n_h^-0.5)."""
        q = self.q_b_proj(q_residual).view(-1, self.n_heads, self.head_dim)
        return apply_interleaved(q, cos, sin), self.weights_proj(x).float() * self.n_heads ** -0.5

    def score(self, q: torch.Tensor, head_w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [T, n_h, d_I], head_w [T, n_h], keys [T, W, d_I] -> [T, W] fp32."""
        s = torch.relu(torch.einsum("thd,twd->thw", q.float(), keys.float())) * self.head_dim ** -0.5
        return (s * head_w.unsqueeze(-1)).sum(dim=1)


def _ranked(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best valid columns per row (stable: ties -> lowest), -1 where a row has fewer."""
    masked = scores.masked_fill(~valid, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    count = valid.sum(dim=-1, keepdim=True)
    return torch.where(torch.arange(order.shape[1], device=order.device) < count, order, -1)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, k: int,
                allowed: torch.Tensor | None = None) -> torch.Tensor:
    """scores [T, W]; visible [T] entry counts; allowed [T, W] (candidate restriction) -> entries [T, min(k, W)]."""
    valid = torch.arange(scores.shape[1], device=scores.device) < visible[:, None]
    if allowed is not None:
        valid &= allowed
    return _ranked(scores, valid, min(k, scores.shape[1]))


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, block_size: int,
                     num_blocks: int) -> torch.Tensor:
    """Per query, the newest visible block and the ``num_blocks - 1`` other blocks of ``block_size`` entries with the
    highest max visible score -> [T, num_blocks] block ids, -1 pads."""
    t, w = scores.shape
    nb = -(-w // block_size)
    valid = torch.arange(w, device=scores.device) < visible[:, None]
    padded = torch.full((t, nb * block_size), float("-inf"), device=scores.device)
    padded[:, :w] = scores.masked_fill(~valid, float("-inf"))
    block_max = padded.view(t, nb, block_size).amax(dim=-1)
    n_valid = -(-visible // block_size)
    block_valid = torch.arange(nb, device=scores.device) < n_valid[:, None]
    # The newest block (the one holding the query's latest entries) is always a candidate: DeepInfer scores it +inf
    # (tilelang_ops/candidate_blocks.py candidate_block_max), whatever its max.
    newest = (n_valid - 1).clamp_min(0)[:, None]
    block_max.scatter_(1, newest, torch.where(n_valid[:, None] > 0, float("inf"), block_max.gather(1, newest)))
    ranked = _ranked(block_max, block_valid, min(num_blocks, nb))
    if ranked.shape[1] < num_blocks:
        ranked = torch.cat([ranked, ranked.new_full((t, num_blocks - ranked.shape[1]), -1)], dim=1)
    return ranked


def candidate_mask(blocks: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """[T, B] block ids -> [T, width] bool: entry w lies in one of the row's blocks."""
    nb = -(-width // block_size)
    # one flag per block (-1 pads land in a spare column), then widened to entries: [T, nb], not [T, width, B]
    hit = torch.zeros(blocks.shape[0], nb + 1, dtype=torch.bool, device=blocks.device)
    hit.scatter_(1, torch.where(blocks >= 0, blocks.clamp(max=nb), nb), True)
    return hit[:, :nb].repeat_interleave(block_size, dim=1)[:, :width]
