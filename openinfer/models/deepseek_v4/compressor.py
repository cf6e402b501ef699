"""KV compressor (spec §4.4/§4.5): one softmax-gated entry per window of ``ratio`` tokens, written to paged storage.

Every token stores its raw projections ``[kv | gate]`` (width 2*c*dim, c = 2 when overlapped) in the layer's
token-level store. When a step computes the last token of window w, entry w is pooled from those rows:
- HCA (no overlap): slots = the window's m tokens.
- CSA (overlap, c = 2): slots = the previous window's "Ca" half (channels [:dim]) ++ this window's "Cb" half
  ([dim:]); window 0 has no previous window (kv 0, gate -inf).
gate += ape[slot index in its own window]; per-channel softmax over the slots (fp32); RMSNorm; RoPE (compress θ)
at position w*m. Because the rows are read back by position, a window may be split across steps (chunked
prefill), across a prefix-cache hit boundary, or recomputed after preemption, and the entry is the same.
"""
from __future__ import annotations

import torch
from torch import nn

from openinfer.models.deepseek_v4.cache import StepIndex
from openinfer.layers.linear import CheckpointLinear
from openinfer.layers.norm import RMSNorm
from openinfer.models.deepseek_v4.common import fp32_param
from openinfer.layers.rotary import RotaryEmbedding, apply_interleaved


class Compressor(nn.Module):
    def __init__(self, hidden_size: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim = dim
        self.ratio = ratio
        self.overlap = overlap
        width = (2 if overlap else 1) * dim
        self.kv_proj = CheckpointLinear(hidden_size, width, bias=False)
        self.gate_proj = CheckpointLinear(hidden_size, width, bias=False)
        self.position_bias = fp32_param(ratio, width)
        self.kv_norm = RMSNorm(dim, eps, torch.float32)

    @property
    def row_width(self) -> int:
        return 2 * self.kv_proj.out_features

    def store_rows(self, x: torch.Tensor, slot_mapping: torch.Tensor, store: torch.Tensor) -> None:
        """Write each new token's raw [kv | gate] row into the flat token-level store."""
        rows = torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)
        store.index_copy_(0, slot_mapping, rows.to(store.dtype))

    def pool(self, cur: torch.Tensor, prev: torch.Tensor | None, has_prev: torch.Tensor | None,
             start: torch.Tensor, rotary: RotaryEmbedding, dtype: torch.dtype) -> torch.Tensor:
        """cur/prev [W, m, row_width] rows of each closing window and of the window before it; has_prev [W]
        bool; start [W] first position of each window. Returns the entries [W, dim]."""
        width = self.kv_proj.out_features
        kv, gate = cur.to(dtype).split([width, width], dim=-1)
        gate = gate.float() + self.position_bias
        if self.overlap:
            d = self.dim
            pkv, pgate = prev.to(dtype).split([width, width], dim=-1)
            pgate = (pgate.float() + self.position_bias)[..., :d]
            pgate = pgate.masked_fill(~has_prev[:, None, None], float("-inf"))
            pkv = torch.where(has_prev[:, None, None], pkv[..., :d], pkv.new_zeros(()))
            kv = torch.cat([pkv, kv[..., d:]], dim=1)
            gate = torch.cat([pgate, gate[..., d:]], dim=1)
        weights = gate.softmax(dim=1).to(kv.dtype)
        entries = self.kv_norm((kv * weights).sum(dim=1))
        cos, sin = rotary.cos_sin(start)
        return apply_interleaved(entries, cos, sin)

    def emit(self, step: StepIndex, store: torch.Tensor, entries: torch.Tensor, cap: int, rotary: RotaryEmbedding,
             dtype: torch.dtype) -> None:
        """Pool and write every entry whose window closes in this step (vectorised over windows)."""
        plan = step.memo(("compress", self.ratio, self.overlap, cap), lambda: self._plan(step, cap))
        if plan is None:
            return
        start, has_prev, cur_slots, prev_slots, entry_slots = plan
        prev = store[prev_slots] if self.overlap else None
        out = self.pool(store[cur_slots], prev, has_prev, start, rotary, dtype)
        entries.index_copy_(0, entry_slots, out.to(entries.dtype))

    def _plan(self, step: StepIndex, cap: int):
        """Which windows close in this step and where their rows and entries live: the same for every compressor
        of this ratio in the step (the stores differ, the slots do not), so ``emit`` builds it once per step.
        -> (start, has_prev, cur_slots, prev_slots, entry_slots), or None when no window closes."""
        m = self.ratio
        closing = ((step.positions + 1) % m == 0).nonzero().squeeze(1)
        if closing.numel() == 0:
            return None
        seq = step.token_seq[closing].unsqueeze(1)
        start = step.positions[closing] - (m - 1)
        offsets = torch.arange(m, device=start.device)
        cur_slots = step.token_slots(seq, start[:, None] + offsets)
        has_prev = prev_slots = None
        if self.overlap:
            has_prev = start >= m
            prev_slots = step.token_slots(seq, start[:, None] - m + offsets)
        return start, has_prev, cur_slots, prev_slots, step.entry_slots(seq.squeeze(1), start // m, m, cap)
