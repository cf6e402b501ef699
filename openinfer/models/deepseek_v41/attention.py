"""V4.1 attention over the paged cache (spec §7, DeepInfer ``v4_modules/attn.py``): V4's sink attention with
C1/C2 entries, cross-layer sharing, YOCO and candidate blocks.

  q_residual = RMSNorm(wq_a(x)); q = RoPE(wq_b(q_residual)) per head (no per-head q norm in V4.1)
  kv = RoPE(RMSNorm(wkv(x)))  -> the layer's own sliding window; x is the layer's own attn-norm hidden in YOCO
       consumer layers too: DeepInfer's V4.1 config fixes ``yoco_swa_share_hidden`` False (hugging_face/config.py:47)
  compressed layers: entries come from the layer's KV source (compressed from x there, or from the YOCO shared
  hidden when the source is a YOCO consumer); the chosen entries come from the layer's index source
  keys(t) = window [t - W + 1, t]  ++  chosen entries;  softmax with the per-head sink;  V == K
  out = wo_b(concat_g(o_g @ wo_a[g].T)) after inverse RoPE on o
SWA-only layers use the main RoPE, compressed layers the compress RoPE (YaRN) for everything, as in V4.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from openinfer.forward_context import get_forward_context
from openinfer.layers import cpu_ops
from openinfer.layers.linear import CheckpointLinear
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import apply_interleaved
from openinfer.models.deepseek_v4.attention import sink_attention
from openinfer.models.deepseek_v4.common import fp32_param
from openinfer.models.deepseek_v41.cache import WINDOW, LayerCache, StepIndex
from openinfer.models.deepseek_v41.compression import Compressor
from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.interface import KVStoreOwner, KVStores
from openinfer.models.deepseek_v41.indexer import Indexer, candidate_blocks, candidate_mask, select_topk

# Bytes of gathered index keys / entries per query chunk (as V4's attention).
GATHER_BUDGET_BYTES = 256 << 20


@dataclass
class StepState:
    """What a source layer computes in this step and later layers read (DeepInfer's CrossLayerRuntime)."""

    caches: list[LayerCache | None]
    shared_hidden: torch.Tensor | None = None  # YOCO: attn-norm hidden of the first consumer layer
    emitted: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # kv source -> (slots, pre-RoPE entries)
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> chosen entries [T, k]
    candidates: torch.Tensor | None = None  # [T, candidate_topk_blocks] block ids
    # YOCO shortened prefill (model.py): the step's rows the layers compute now (None: all), and the whole step's
    # index, which compressed-KV sources past the boundary still emit over (from the shared hidden, every row).
    rows: torch.Tensor | None = None
    full_step: StepIndex | None = None


def window_positions(positions: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query positions [T] -> (the sliding window's key positions [T, window]: p - window + 1 .. p, valid [T, window]:
    not before the sequence start)."""
    win = positions[:, None] - (window - 1) + torch.arange(window, device=positions.device)
    return win, win >= 0


class Attention(nn.Module, KVStoreOwner):
    def __init__(self, cfg: DeepseekV41Config, layer: int) -> None:
        super().__init__()
        hidden, eps, topo = cfg.hidden_size, cfg.rms_norm_eps, cfg.topology
        self.layer, self.cfg = layer, cfg
        self.ratio = cfg.ratio(layer)
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.o_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.scale = cfg.head_dim ** -0.5
        self.rope_name = "compress" if self.ratio else "main"
        self.q_a_proj = CheckpointLinear(hidden, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, eps, torch.float32)
        self.q_b_proj = CheckpointLinear(cfg.q_lora_rank, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.kv_proj = CheckpointLinear(hidden, cfg.head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.head_dim, eps, torch.float32)
        self.o_a_proj = CheckpointLinear(cfg.num_attention_heads * cfg.head_dim // cfg.o_groups,
                                         cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.o_a_proj.prepack = False  # project_out reads its weight as a grouped matrix
        self.o_b_proj = CheckpointLinear(cfg.o_groups * cfg.o_lora_rank, hidden, bias=False)
        self.sinks = fp32_param(cfg.num_attention_heads)
        r = self.ratio
        self.kv_source = topo.kv_source[layer] if r else None
        self.index_source = topo.index_source[layer] if r else None
        self.index_k_source = topo.index_k_source[layer] if r else None
        self.yoco_consumer = topo.is_yoco_consumer(layer)
        self.uses_candidates = bool(r) and topo.uses_candidates(layer)
        self.is_candidate_source = bool(r) and topo.candidate_source == layer
        self.compressor = (Compressor(hidden, cfg.head_dim, r, eps) if r and self.kv_source == layer else None)
        self.indexer = (Indexer(hidden, cfg.q_lora_rank, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim,
                                self.index_k_source == layer, eps) if r and self.index_source == layer else None)
        self.cache: LayerCache | None = None

    def kv_stores(self) -> KVStores:
        """The bound cache's stores, each in its group; none while unbound."""
        return [] if self.cache is None else self.cache.stores()

    # -- projections shared with the whole-sequence reference ------------------------------------------
    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """-> (q [T, H, d] roped, q_residual [T, q_lora], kv [T, d] roped)."""
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = apply_interleaved(self.q_b_proj(q_residual).view(-1, self.num_heads, self.head_dim), cos, sin)
        return q, q_residual, apply_interleaved(self.kv_norm(self.kv_proj(x)), cos, sin)

    def project_out(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        o = apply_interleaved(o, cos, sin, inverse=True)
        t, g = o.shape[0], self.o_groups
        w = self.o_a_proj.weight.view(g, self.o_lora_rank, -1)
        return self.o_b_proj(torch.einsum("tgi,goi->tgo", o.reshape(t, g, -1), w).reshape(t, -1))

    # -- paged path --------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, step: StepIndex, rope: dict, state: StepState) -> torch.Tensor:
        if self.cache is None:
            raise RuntimeError(f"layer {self.layer}: no KV cache bound (bind_kv_cache not called)")
        cos, sin = rope[self.rope_name]
        slot_mapping = get_forward_context().group(WINDOW).slot_mapping
        q, q_residual, kv = self.project(x, cos, sin)
        own = slot_mapping if state.rows is None else slot_mapping[state.rows]
        store = self.cache.flat("kv")
        store.index_copy_(0, own, kv.to(store.dtype))
        if self.ratio:
            if self.compressor is not None:
                if self.yoco_consumer:  # entries of every row of the step, from the shared hidden
                    self._emit(state.shared_hidden, state.full_step or step, slot_mapping, rope, state)
                else:
                    self._emit(x, step, slot_mapping, rope, state)
            if self.indexer is not None and self.indexer.wk is not None:
                self._store_index_keys(step, rope, state)
        # Queries in chunks: a long prefill's [T, entries, d] gathers would not fit otherwise.
        out = torch.empty_like(q)
        t, chunk = x.shape[0], self._query_chunk(step, state)
        chosen_parts, candidate_parts = [], []
        for s in range(0, t, chunk):
            e = min(t, s + chunk)
            sub = step.slice(s, e)
            chosen = None
            if self.ratio:
                chosen, cands = self._choose(q_residual[s:e], x[s:e], sub, cos[s:e], sin[s:e], state, s, e)
                chosen_parts.append(chosen)
                candidate_parts.append(cands)
            out[s:e] = self._attend(q[s:e], sub, chosen, state)
        if self.indexer is not None:
            state.topk[self.layer] = torch.cat(chosen_parts)
        if self.is_candidate_source:
            state.candidates = torch.cat(candidate_parts)
        return self.project_out(out, cos, sin)

    def _query_chunk(self, step: StepIndex, state: StepState) -> int:
        # what attending gathers per query: its window and its chosen entries
        per_query = self.window * self.head_dim + (self.cfg.index_topk * self.head_dim if self.ratio else 0)
        if self.indexer is not None and not self._kernel_scores(state):
            # the torch scoring path gathers every visible index key and scores [heads, entries] per query
            entries = int(step.positions.max()) + 1
            per_query += entries * (self.cfg.index_head_dim + self.cfg.index_n_heads)
        return max(1, GATHER_BUDGET_BYTES // (per_query * 4))

    def _kernel_scores(self, state: StepState) -> bool:
        """Whether the CPU kernel scores this layer's index keys in place (cpu_ops.indexer_select)."""
        store = state.caches[self.index_k_source].flat("index_keys")
        return isinstance(store, torch.Tensor) and cpu_ops.ops_for(store) is not None

    def _emit(self, h: torch.Tensor, step: StepIndex, slot_mapping: torch.Tensor, rope: dict,
              state: StepState) -> None:
        """Write every entry whose window closes in this step; keep the pre-RoPE entries for index keys."""
        m, comp = self.ratio, self.compressor
        rows = comp.rows(h)
        pos = step.positions
        closing = ((pos + 1) % m == 0).nonzero().squeeze(1)
        if m == 2:
            store = self.cache.flat("comp")
            store.index_copy_(0, slot_mapping, rows.to(store.dtype))
            seq = step.token_seq[closing, None]
            window_rows = store[step.token_slots(seq, pos[closing, None] - 1 + torch.arange(2, device=pos.device))]
        else:
            window_rows = rows[closing, None]
        pre = comp.pool(window_rows.to(h.dtype))
        start = pos[closing] - (m - 1)
        cos, sin = rope[self.rope_name + "_fn"](start)
        slots = step.entry_slots(step.token_seq[closing], start // m, m, self.cache.entry_cap)
        entries = self.cache.flat("entries")
        entries.index_copy_(0, slots, apply_interleaved(pre, cos, sin).to(entries.dtype))
        state.emitted[self.layer] = (slots, pre, start)

    def _store_index_keys(self, step: StepIndex, rope: dict, state: StepState) -> None:
        slots, pre, start = state.emitted[self.kv_source]
        cos, sin = rope[self.rope_name + "_fn"](start)
        keys = self.cache.flat("index_keys")
        keys.index_copy_(0, slots, self.indexer.keys(pre, cos, sin).to(keys.dtype))

    def _choose(self, q_residual, x, step: StepIndex, cos, sin, state: StepState, s: int,
                e: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (chosen entries [t, k] of the queries [s, e), this layer's candidate blocks for them or None)."""
        if self.indexer is None:  # share-index: the source's choice for these very tokens
            return state.topk[self.index_source][s:e], None
        m, cfg = self.ratio, self.cfg
        visible = (step.positions + 1) // m
        width = int(visible.max())
        if width == 0:
            empty = torch.full((x.shape[0], cfg.index_topk), -1, dtype=torch.long, device=x.device)
            blocks = torch.full((x.shape[0], cfg.topology.candidate_topk_blocks), -1, dtype=torch.long,
                                device=x.device)
            return empty, blocks if self.is_candidate_source else None
        q, head_w = self.indexer.query(q_residual, x, cos, sin)
        src = state.caches[self.index_k_source]
        if src.numerics.index_keys is not None:  # DeepInfer casts the indexer's queries as its keys (FP4)
            q = src.numerics.index_keys.round_trip(q)
        store = src.flat("index_keys")
        topo = cfg.topology
        if isinstance(store, torch.Tensor) and (step.coarse_tables is None or m != step.coarse_tokens):
            # CPU kernel: keys read in place through the block tables, only the candidate blocks' keys where the
            # layer is restricted, a top-k selection instead of a sort (cpu_kernels/indexer_select.cpp)
            picked = cpu_ops.indexer_select(
                q, head_w, store, step.tables, step.token_seq, visible, cfg.index_topk,
                self.indexer.head_dim ** -0.5, m, step.block_size, src.entry_cap, topo.candidate_block_size,
                topo.candidate_topk_blocks if self.is_candidate_source else 0,
                state.candidates[s:e] if self.uses_candidates else None)
            if picked is not None:
                return picked
        windows = torch.arange(width, device=x.device)
        keys = store[step.entry_slots(step.token_seq[:, None], windows[None, :], m, src.entry_cap)]
        scores = self.indexer.score(q, head_w, keys)
        allowed = blocks = None
        if self.is_candidate_source:
            blocks = candidate_blocks(scores, visible, topo.candidate_block_size, topo.candidate_topk_blocks)
        elif self.uses_candidates:
            allowed = candidate_mask(state.candidates[s:e], width, topo.candidate_block_size)
        chosen = select_topk(scores, visible, cfg.index_topk, allowed)
        if chosen.shape[1] < cfg.index_topk:  # chunks of one step must agree in width
            chosen = torch.cat([chosen, chosen.new_full((chosen.shape[0], cfg.index_topk - chosen.shape[1]), -1)], 1)
        return chosen, blocks

    def _attend(self, q: torch.Tensor, step: StepIndex, chosen: torch.Tensor | None,
                state: StepState) -> torch.Tensor:
        pos, seq = step.positions, step.token_seq[:, None]
        win_pos, valid = window_positions(pos, self.window)
        keys = self.cache.flat("kv")[step.token_slots(seq, win_pos)]
        if chosen is not None and chosen.shape[1]:
            src = state.caches[self.kv_source]
            slots = step.entry_slots(seq, chosen, self.ratio, src.entry_cap)
            keys = torch.cat([keys, src.flat("entries")[slots]], dim=1)
            valid = torch.cat([valid, chosen >= 0], dim=1)
        return sink_attention(q, keys, valid, self.sinks, self.scale)
