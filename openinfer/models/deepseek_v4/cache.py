"""Paged KV-cache layout for DeepSeek-V4, and the per-step index that turns (sequence, position) into slots.

Invariant (engine-wide): every piece of per-sequence state lives in paged storage indexed by the sequence's block
tables and keyed by token position, so chunked prefill, prefix-cache hits and preemption-by-recompute need nothing
else. Per layer (d = head_dim, di = index_head_dim, m = compress ratio, bs = block_size), in KV groups
(kv_cache_interface.py: ``full`` whole-life, ``window`` sliding, ``coarse`` whole-life with big blocks) whose tables
share the chain of prefix hashes:

window group, token-level stores ``[num_window_blocks, bs, width]`` (row = the token's own contribution):
  ``kv``          d       the token's normed, roped latent (K == V) - read for the sliding window
  ``comp``        2*c*d   the compressor's raw kv | gate projections (c = 2 for the overlapped CSA, else 1) -
                          read when the window holding the token (or, for CSA, the next one) closes
  ``index_comp``  4*di    the same for the indexer's compressor (CSA only)
full group, entry-level stores ``[num_blocks, ceil(bs/m), width]``:
  ``entries``        d    compressed entry w (normed, roped at w*m)
  ``index_entries``  di   indexer key w (CSA only)
coarse group, when the largest ratio M spans whole blocks (M > bs, M % bs == 0: V4-Flash's HCA, M = 128): the
  entry stores of the layers with ratio M are ``[num_coarse_blocks, 1, width]``, coarse block k holding entry
  k. In the full group they would take one entry slot in every block, though only one block in M/bs holds one.

Token-level rows are only read within ``lookback_tokens`` = max(W - 1, c*m - 1) positions before a query (the
window reads p - W + 1 .. p; an entry closing at e >= p reads its window's rows from e - m + 1, for CSA the window
before too, from e - 2m + 1): 127 for V4-Flash. So the block manager (engine/hybrid_kv_cache_manager.py) releases
a running sequence's window blocks once they lie wholly behind that lookback; the window table then holds
block 0 there, never read. Entry w is read for the whole sequence life, so entries live in the full (or coarse)
group.

Entry w is written in the step that computes its window's *last* token e = (w+1)*m - 1 and lives in the full
group block holding e, at slot (e % bs) // m (coarse layers: in coarse block w, hashed with the key of the full
block holding e). Keying it by the *last* token (not the first, w*m) is what makes prefix sharing safe when
m > bs: a block is only shared between sequences whose tokens agree up to the end of that block, hence over the
whole window; a block holding w*m can be shared by sequences that diverge later in the window, and both would
write their different entry w into it.

Size (``DeepseekV4ForCausalLM.kv_cache_spec`` reports what this layout allocates; the engine logs it). V4-Flash
(d 512, di 128; 21 CSA m=4, 20 HCA m=128, 2 SWA-only layers; the MTP layer has no cache yet), bf16, bs 16:
- what every token holds for its sequence's whole life: 6,880 B/token = full group 6,720 (per CSA layer
  2*(512 + 128)*4 entries/16 = 320 B) + coarse group 160 (per HCA layer 2*512 B per 128 tokens = 8 B). SWA-only
  layers hold nothing for long. DeepSeek-V3 at its real config in bf16 (61 layers x (512 + 64) x 2 B) holds
  70,272 B/token: 10.2x more. Production (vLLM fp8_ds_mla: fp8 entries with UE8M0 scales, 584 B per 512-d
  entry, 132 B per indexer key) is ~3.85 KB/token against V3's 40 KB in FlashMLA.
- window group: 192,512 B/token (per CSA layer 2*(512 + 2048 + 512) = 6144 B, per HCA 2*(512 + 1024) = 3072 B,
  per SWA 1024 B), but a decoding sequence holds at most ceil(127/16) + 2 = 10 of its blocks: 30.8 MB per
  running sequence whatever its length (the long-lived cost of ~4,480 tokens).
kv_cache_dtype fp8 (fp8_ds_mla, ``DS_MLA_STORES``): the ``kv`` and ``entries`` rows are packed fp8 latents (584 B
instead of 1024 per 512-d row) and the indexer keys fp8 with an fp32 scale each (132 B instead of 256,
``FP8_ROW_STORES``); V4-Flash then holds 3,851 B/token for its whole life (full group 21 x (584 + 132) per 4 tokens
= 3,759 + coarse 20 x 584 per 128 = 91.25), vLLM's ~3.85 KB.
Next steps: replacing the raw ``comp`` rows by a per-block online-softmax running state (shrinks the window
group ~4x); fp8/fp4 indexer keys.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from openinfer.forward_context import AttentionMetadata
from openinfer.layers.kv_quant import DsMlaLayout, Fp8RowLayout, PackedRows, is_fp8
from openinfer.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config


# The model's KV group names (kv_cache_spec).
FULL = "full"  # entry-level stores, read for the whole sequence life
WINDOW = "window"  # token-level stores, read within lookback_tokens of the query
COARSE = "coarse"  # the entries of the ratio that spans whole blocks, one block per entry


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


def coarse_ratio(cfg: DeepseekV4Config, block_size: int) -> int | None:
    """The compress ratio whose entries live in the coarse group (one block per entry window), or None. Only
    the largest ratio, and only when it spans whole blocks: smaller ratios fit several entries per block."""
    m = max(cfg.compress_ratios[:cfg.num_hidden_layers], default=0)
    return m if m > block_size and m % block_size == 0 else None


# kv_cache_dtype fp8 (= fp8_ds_mla on V4, as in vLLM): the stores of head_dim latents - the window's token
# latents and the compressed entries, the rows attention reads - hold packed fp8_ds_mla rows
# (layers/kv_quant.DsMlaLayout: 584 B for V4-Flash's 512-d). The compressor's raw rows and the indexer's stores keep
# the model's dtype.
DS_MLA_STORES = ("kv", "entries")
# ... and the indexer keys as fp8 with an fp32 scale per key (vLLM's 132 B per 128-d key).
FP8_ROW_STORES = ("index_entries",)


def ds_mla_layout(cfg: DeepseekV4Config) -> DsMlaLayout:
    return DsMlaLayout(cfg.head_dim, cfg.qk_rope_head_dim)


def fp8_layout(cfg: DeepseekV4Config, name: str) -> DsMlaLayout | Fp8RowLayout | None:
    """How store ``name`` is packed under kv_cache_dtype fp8 (None: it keeps the model's dtype)."""
    if name in DS_MLA_STORES:
        return ds_mla_layout(cfg)
    if name in FP8_ROW_STORES:
        return Fp8RowLayout(cfg.index_head_dim)
    return None


def _store_bytes(cfg: DeepseekV4Config, name: str, width: int, elem_size: int, fp8: bool) -> int:
    """Bytes of one row of store ``name``."""
    layout = fp8_layout(cfg, name) if fp8 else None
    return layout.row_bytes if layout is not None else elem_size * width


def layer_bytes_per_block(cfg: DeepseekV4Config, layer_idx: int, block_size: int,
                          elem_size: int, fp8: bool = False) -> tuple[int, int, int]:
    """(window-group bytes per block, full-group bytes per block, coarse-group bytes per coarse block) this
    layer takes, blocks of ``block_size`` tokens (coarse blocks: ``coarse_ratio`` tokens). ``elem_size``: the
    model dtype's; ``fp8``: the latent stores packed as fp8_ds_mla."""
    tok, ent = layer_store_widths(cfg, layer_idx)
    ratio = cfg.compress_ratios[layer_idx]
    window = block_size * sum(_store_bytes(cfg, n, w, elem_size, fp8) for n, w in tok.items())
    entry = sum(_store_bytes(cfg, n, w, elem_size, fp8) for n, w in ent.items())
    if ratio and ratio == coarse_ratio(cfg, block_size):
        return window, 0, entry
    return window, entries_per_block(block_size, max(ratio, 1)) * entry, 0


def lookback_tokens(cfg: DeepseekV4Config) -> int:
    """How far before a query position p the token-level stores are read: the sliding window reads rows
    p - (W - 1) .. p; an entry emitted at its window's last token e reads the compressor rows of its window,
    e - (m - 1) .. e, and for the overlapped CSA also the window before, from e - (2m - 1)."""
    back = cfg.sliding_window - 1
    for kind, m in zip(cfg.layer_types[:cfg.num_hidden_layers], cfg.compress_ratios):
        if kind != SLIDING:
            back = max(back, (2 if kind == CSA else 1) * m - 1)
    return back


class V4LayerCache:
    """One layer's paged stores (see the module docstring); tensors are attributes named like the stores."""

    def __init__(self, cfg: DeepseekV4Config, layer_idx: int, num_blocks: dict[str, int], block_size: int,
                 dtype: torch.dtype, device: torch.device, kv_dtype: torch.dtype | None = None) -> None:
        """``dtype``: the model's; ``kv_dtype`` float8_e4m3fn packs the latent stores as fp8_ds_mla."""
        self.block_size = block_size
        fp8 = kv_dtype is not None and is_fp8(kv_dtype)
        self.ds_mla = ds_mla_layout(cfg) if fp8 else None
        self.layouts = {n: fp8_layout(cfg, n) for n in DS_MLA_STORES + FP8_ROW_STORES} if fp8 else {}
        self.dtype = dtype
        self.ratio = cfg.compress_ratios[layer_idx]
        self.coarse = bool(self.ratio) and self.ratio == coarse_ratio(cfg, block_size)
        self.entry_cap = 1 if self.coarse else entries_per_block(block_size, max(self.ratio, 1))
        num_entry_blocks = num_blocks[COARSE] if self.coarse else num_blocks[FULL]
        tok, ent = layer_store_widths(cfg, layer_idx)
        self.names = list(tok) + list(ent)
        # The KV group whose blocks each store's first dimension indexes (what a KV connector transfers).
        self.store_groups = {**{n: WINDOW for n in tok}, **{n: COARSE if self.coarse else FULL for n in ent}}
        for name, width in tok.items():  # the window group's blocks
            setattr(self, name, self._store(name, (num_blocks[WINDOW], block_size), width, device))
        for name, width in ent.items():  # the full (or coarse) group's blocks
            setattr(self, name, self._store(name, (num_entry_blocks, self.entry_cap), width, device))

    def _store(self, name: str, lead: tuple[int, int], width: int, device: torch.device) -> torch.Tensor:
        if self.packed(name):
            return torch.zeros(*lead, self.layouts[name].row_bytes, dtype=torch.uint8, device=device)
        return torch.zeros(*lead, width, dtype=self.dtype, device=device)

    def packed(self, name: str) -> bool:
        return name in self.layouts

    def flat(self, name: str) -> torch.Tensor | PackedRows:
        """[slots, width] rows of store ``name``; a packed store reads and writes through ``PackedRows``."""
        t = getattr(self, name)
        rows = t.view(-1, t.shape[-1])
        return PackedRows(rows, self.layouts[name], self.dtype) if self.packed(name) else rows

    def raw(self, name: str) -> torch.Tensor:
        """The store's own [slots, row] tensor (packed bytes for a packed store): what the C++ kernel reads."""
        t = getattr(self, name)
        return t.view(-1, t.shape[-1])

    def stores(self) -> list[tuple[str, torch.Tensor]]:
        """(KV group, store) per store, in ``names`` order: what ``kv_stores`` reports (a KV connector's tensors)."""
        return [(self.store_groups[name], getattr(self, name)) for name in self.names]


@dataclass
class StepIndex:
    """Per-step view of the forward context, built once and shared by all layers.

    tables [S, max_blocks]: the full group's block tables (entry-level stores); win_tables, same shape: the
    window group's (token-level stores; None = the same tables). Both are padded with block 0, never read past
    a sequence's own length, and win_tables holds block 0 where the manager released blocks behind the
    lookback (never read either). token_seq [T] (row of each token in the tables), positions [T]."""

    tables: torch.Tensor
    token_seq: torch.Tensor
    positions: torch.Tensor
    block_size: int
    win_tables: torch.Tensor | None = None
    # The coarse group's tables [S, max coarse blocks] and its block span (= the coarse layers' ratio).
    coarse_tables: torch.Tensor | None = None
    coarse_tokens: int | None = None
    # Index tensors that depend only on this step (not on a layer's weights or stores), computed by the first
    # layer that asks and reused by the others: the 8-61 layers of a step share a handful of ratios, and each
    # such index is a few small ops (and a host read) that ran once per layer per step. See ``memo``.
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, md: AttentionMetadata, positions: torch.Tensor, coarse_tokens: int | None = None) -> StepIndex:
        coarse = md.groups.get(COARSE)
        return cls(md.group(FULL).block_tables, md.token_rows, positions, md.block_size,
                   md.group(WINDOW).block_tables, coarse.block_tables if coarse is not None else None, coarse_tokens)

    def slice(self, start: int, end: int) -> StepIndex:
        """The tokens [start, end) of this step (same tables); the whole step is itself, and a slice is built
        once per step, so the layers that query in the same chunks share its memo."""
        if start == 0 and end == self.positions.shape[0]:
            return self
        return self.memo(("slice", start, end), lambda: StepIndex(
            self.tables, self.token_seq[start:end], self.positions[start:end], self.block_size, self.win_tables,
            self.coarse_tables, self.coarse_tokens))

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per step and key; later calls with the key return the same object (treat as
        read-only). Keys name what is built and every argument it depends on besides this step."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    @property
    def max_position(self) -> int:
        """The largest position in this step (one host read per step, not one per layer)."""
        return self.memo("max_position", lambda: int(self.positions.max()))

    @property
    def token_tables(self) -> torch.Tensor:
        return self.tables if self.win_tables is None else self.win_tables

    def token_slots(self, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Flat token-store slot of position ``pos`` (clamped at 0; callers mask negatives) of sequence row ``seq``;
        seq broadcasts against pos (advanced indexing)."""
        pos = pos.clamp(min=0)
        bs = self.block_size
        return self.token_tables[seq, pos // bs] * bs + pos % bs

    def entry_slots(self, seq: torch.Tensor, window: torch.Tensor, ratio: int, cap: int) -> torch.Tensor:
        """Flat entry-store slot of compressed entry ``window`` (clamped at 0) - see the module docstring."""
        if ratio == self.coarse_tokens and self.coarse_tables is not None:  # coarse block w holds entry w only
            return self.coarse_tables[seq, window.clamp(min=0)]
        end = (window.clamp(min=0) + 1) * ratio - 1
        bs = self.block_size
        return self.tables[seq, end // bs] * cap + (end % bs) // ratio
