"""Lightning indexer (CSA layers, spec §4.4): picks, per query, the top ``index_topk`` visible compressed entries.

  K^I_w = indexer compressor entry w (own overlapped compressor at index_head_dim, RoPE at w*m)
  q^I   = RoPE(wq_b(q_residual)).view(index_n_heads, index_head_dim)
  I[t, w] = sum_h (weights_proj(x)[t, h] * n_h^-0.5) * ReLU(q^I_{t,h} . K^I_w) * d_I^-0.5,  w visible iff
  w < (t + 1) // m.
Ties are broken towards the lowest entry index (a stable descending sort). On CPU one kernel pass per query scores
the visible entries in place and selects the top k (``cpu_ops.indexer_select``; ``cpu_ops.indexer_topk`` for fp8
keys); the torch code is the fallback. HF uses ``torch.topk``, whose tie order
depends on the tensor length, so on exact ties (ReLU makes many scores exactly 0) HF's prefill and decode can pick
different entries; where HF has no ties the two agree.
"""
from __future__ import annotations

import torch
from torch import nn

from openinfer.layers import cpu_ops
from openinfer.layers.kv_quant import PackedRows
from openinfer.models.deepseek_v4.cache import StepIndex
from openinfer.distributed.parallel_state import get_tp_group
from openinfer.layers.parallel_linear import ColumnParallelLinear, divide
from openinfer.models.deepseek_v4.compressor import Compressor
from openinfer.layers.rotary import apply_interleaved


class Indexer(nn.Module):
    """Under tensor parallelism each rank holds a slice of the indexer heads: its scores are partial sums over
    those heads, summed across ranks before the top-k (so every rank selects the same entries)."""

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, ratio: int, topk: int,
                 eps: float) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.n_heads = n_heads  # all of them: the head weights are scaled by n_heads^-0.5
        self.num_local_heads = divide(n_heads, self.tp.world_size, "index_n_heads")
        self.head_dim = head_dim
        self.ratio = ratio
        self.topk = topk
        self.compressor = Compressor(hidden_size, head_dim, ratio, overlap=True, eps=eps)
        self.q_b_proj = ColumnParallelLinear(q_lora_rank, [n_heads * head_dim], bias=False)
        self.weights_proj = ColumnParallelLinear(hidden_size, [n_heads], bias=False)

    def query(self, q_residual: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> (q [T, n_h, d_I] roped, head weights [T, n_h] fp32, already scaled by n_h^-0.5); this rank's heads."""
        q = self.q_b_proj(q_residual).view(-1, self.num_local_heads, self.head_dim)
        q = apply_interleaved(q, cos, sin)
        return q, self.weights_proj(x).float() * self.n_heads ** -0.5

    def score(self, q: torch.Tensor, head_w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [T, n_h, d_I], head_w [T, n_h], keys [T, W, d_I] -> index scores [T, W] (fp32)."""
        s = torch.einsum("thd,twd->thw", q.float(), keys.float())
        s = torch.relu(s) * self.head_dim ** -0.5
        return (s * head_w.unsqueeze(-1)).sum(dim=1)

    def select(self, q_residual: torch.Tensor, x: torch.Tensor, step: StepIndex, index_entries: torch.Tensor,
               cap: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """-> chosen entry indices [T, k] (long), -1 where a query has fewer than k visible entries.
        The indexer's own entries for this step must already be emitted."""
        m = self.ratio
        visible = (step.positions + 1) // m
        max_visible = (step.max_position + 1) // m
        t = x.shape[0]
        if max_visible == 0:
            return torch.empty(t, 0, dtype=torch.long, device=x.device)
        q, head_w = self.query(q_residual, x, cos, sin)
        windows = torch.arange(max_visible, device=x.device)
        k = min(self.topk, max_visible)
        if self.tp.world_size == 1 and not isinstance(index_entries, PackedRows) and (
                step.coarse_tables is None or m != step.coarse_tokens):
            # CPU kernel: keys read in place through the block tables, each tile shared by a sequence's queries,
            # a top-k selection instead of a sort (cpu_kernels/indexer_select.cpp, V4.1's indexer kernel)
            picked = cpu_ops.indexer_select(q, head_w, index_entries, step.tables, step.token_seq, visible, k,
                                            self.head_dim ** -0.5, m, step.block_size, cap)
            if picked is not None:
                return picked[0]
        if self.tp.world_size == 1:
            # CPU kernel for fp8 rows: each query's visible keys scored in place and only k of them selected
            raw = index_entries.data if isinstance(index_entries, PackedRows) else index_entries  # fp8 rows as is
            # each sequence's entry slots: the same table for every CSA layer of the step
            slots = step.memo(("index_slots", m, cap), lambda: step.entry_slots(
                torch.arange(step.tables.shape[0], device=x.device)[:, None], windows[None, :], m, cap))
            chosen = cpu_ops.indexer_topk(q, head_w, raw, slots, step.token_seq, visible, k,
                                          self.head_dim ** -0.5)
            if chosen is not None:
                return chosen
        keys = index_entries[step.entry_slots(step.token_seq[:, None], windows[None, :], m, cap)]
        scores = self.tp.all_reduce(self.score(q, head_w, keys))
        hidden = windows[None, :] >= visible[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
        chosen = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        return torch.where(chosen < visible[:, None], chosen, torch.full_like(chosen, -1))
