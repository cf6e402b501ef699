"""Paged KV-cache layout for DeepSeek-V4, and the per-step index that turns (sequence, position) into slots.

Invariant (engine-wide): every piece of per-sequence state lives in paged storage indexed by the sequence's block
table and keyed by token position, so chunked prefill, prefix-cache hits and preemption-by-recompute need nothing
else. Per layer (d = head_dim, di = index_head_dim, m = compress ratio, bs = block_size):

token-level stores ``[num_blocks, bs, width]`` (row = the token's own contribution):
  ``kv``          d       the token's normed, roped latent (K == V) - read for the sliding window
  ``comp``        2*c*d   the compressor's raw kv | gate projections (c = 2 for the overlapped CSA, else 1) -
                          read when the window holding the token (or, for CSA, the next one) closes
  ``index_comp``  4*di    the same for the indexer's compressor (CSA only)
entry-level stores ``[num_blocks, ceil(bs/m), width]``:
  ``entries``        d    compressed entry w (normed, roped at w*m)
  ``index_entries``  di   indexer key w (CSA only)

Entry w is written in the step that computes its window's *last* token e = (w+1)*m - 1 and lives in the block
holding e, at slot (e % bs) // m. Keying it by the *last* token (not the first, w*m) is what makes prefix
sharing safe when m > bs: a block is only shared between sequences whose tokens agree up to the end of that
block, hence over the whole window; a block holding w*m can be shared by sequences that diverge later in the
window, and both would write their different entry w into it.

Size versus the production layout (spec §5). ``kv_bytes_per_block`` reports what this layout allocates. For
V4-Flash (d 512, di 128; 21 CSA m=4, 20 HCA m=128, 2 SWA-only layers; the MTP layer has no cache yet) in bf16
with block_size 16 that is 200,512 B = ~196 KiB/token: per CSA layer 2*(512 + 2048 + 512) + 2*640/4 = 6464 B,
per HCA layer 2*(512 + 1024) + 2*512/16 = 3136 B, per SWA layer 1024 B. Production (vLLM fp8_ds_mla) needs
~3.85 KB/token and V3 (FlashMLA) 40 KB. Where the difference goes:
- ``comp``/``index_comp`` (~4.4 KiB of each CSA layer's 6.3): raw rows are dead once their window (for CSA: the
  next window) closes. Next step: replace them by a per-block running state (online-softmax max / sum / weighted
  sum of the open window(s), fp32; for CSA also the next entry's "Ca" part): a partially filled block is never
  shared, and a full block's final state is exactly what a prefix-cache hit starting after it needs. That is
  ~6*d*4 B per block, cutting V4-Flash to ~80 KiB/token; prefill then needs segment-wise online-softmax merges.
- ``kv`` (43 x 1 KiB): tokens older than sliding_window are never read again. Freeing them means the block
  manager releasing a sequence's blocks that lie wholly outside the window (and behind every open compressor
  window) while keeping their block-table positions and prefix hashes; entries must then move to their own
  pool (or stay in the un-freed blocks' slots), since entry w is read for the whole sequence lifetime.
- fp8 entries/latents with UE8M0 scales (584 B per 512-d entry) and fp8/fp4 indexer keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from openinfer.executor.forward_context import AttentionMetadata
from openinfer.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config


def entries_per_block(block_size: int, ratio: int) -> int:
    return -(-block_size // ratio)


def layer_store_widths(cfg: DeepseekV4Config, layer_idx: int) -> tuple[dict[str, int], dict[str, int]]:
    """(token-level widths, entry-level widths) of one layer's stores, in elements."""
    kind, d, di = cfg.layer_types[layer_idx], cfg.head_dim, cfg.index_head_dim
    if kind == SLIDING:
        return {"kv": d}, {}
    if kind == CSA:
        return {"kv": d, "comp": 4 * d, "index_comp": 4 * di}, {"entries": d, "index_entries": di}
    return {"kv": d, "comp": 2 * d}, {"entries": d}


def layer_bytes_per_block(cfg: DeepseekV4Config, layer_idx: int, block_size: int, elem_size: int) -> int:
    tok, ent = layer_store_widths(cfg, layer_idx)
    cap = entries_per_block(block_size, max(cfg.compress_ratios[layer_idx], 1))
    return elem_size * (block_size * sum(tok.values()) + cap * sum(ent.values()))


class V4LayerCache:
    """One layer's paged stores (see the module docstring); tensors are attributes named like the stores."""

    def __init__(self, cfg: DeepseekV4Config, layer_idx: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        self.ratio = cfg.compress_ratios[layer_idx]
        self.entry_cap = entries_per_block(block_size, max(self.ratio, 1))
        tok, ent = layer_store_widths(cfg, layer_idx)
        self.names = list(tok) + list(ent)
        for name, width in tok.items():
            setattr(self, name, torch.zeros(num_blocks, block_size, width, dtype=dtype, device=device))
        for name, width in ent.items():
            setattr(self, name, torch.zeros(num_blocks, self.entry_cap, width, dtype=dtype, device=device))

    def flat(self, name: str) -> torch.Tensor:
        t = getattr(self, name)
        return t.view(-1, t.shape[-1])


@dataclass
class StepIndex:
    """Per-step view of the forward context, built once and shared by all layers.

    tables [S, max_blocks] (padded with block 0, never read past a sequence's own length), token_seq [T] (row of
    each token in tables), positions [T]."""

    tables: torch.Tensor
    token_seq: torch.Tensor
    positions: torch.Tensor
    block_size: int

    @classmethod
    def build(cls, md: AttentionMetadata, positions: torch.Tensor) -> StepIndex:
        dev = positions.device
        nd = md.num_decodes
        widths = [int(s.block_table.numel()) for s in md.prefills]
        if nd:
            widths.append(int(md.decode_block_tables.shape[1]))
        tables = torch.zeros(nd + len(md.prefills), max(widths), dtype=torch.long, device=dev)
        counts = torch.ones(nd + len(md.prefills), dtype=torch.long, device=dev)
        if nd:
            tables[:nd, :md.decode_block_tables.shape[1]] = md.decode_block_tables
        for i, span in enumerate(md.prefills):  # a handful of prompt chunks per step
            tables[nd + i, :span.block_table.numel()] = span.block_table
            counts[nd + i] = span.query_len
        token_seq = torch.repeat_interleave(torch.arange(tables.shape[0], device=dev), counts)
        return cls(tables, token_seq, positions, md.block_size)

    def slice(self, start: int, end: int) -> StepIndex:
        """The tokens [start, end) of this step (same tables)."""
        return StepIndex(self.tables, self.token_seq[start:end], self.positions[start:end], self.block_size)

    def token_slots(self, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Flat token-store slot of position ``pos`` (clamped at 0; callers mask negatives) of sequence row ``seq``;
        seq broadcasts against pos (advanced indexing)."""
        pos = pos.clamp(min=0)
        bs = self.block_size
        return self.tables[seq, pos // bs] * bs + pos % bs

    def entry_slots(self, seq: torch.Tensor, window: torch.Tensor, ratio: int, cap: int) -> torch.Tensor:
        """Flat entry-store slot of compressed entry ``window`` (clamped at 0) - see the module docstring."""
        end = (window.clamp(min=0) + 1) * ratio - 1
        bs = self.block_size
        return self.tables[seq, end // bs] * cap + (end % bs) // ratio
