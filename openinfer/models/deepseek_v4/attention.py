"""V4 attention (spec §4.3-4.5): one 512-d latent is both K and V; SWA window + compressed entries; learned sinks.

  q_residual = RMSNorm(q_a_proj(x));  q = RMSNorm_noweight_per_head(q_b_proj(q_residual)); RoPE on the trailing
  rope dims (interleaved pairs); kv = RoPE(RMSNorm(kv_proj(x)))
  keys(t) = window [t - sliding_window + 1, t]  ++  compressed entries: all visible (HCA) or the indexer's top-k (CSA)
  p = softmax([q.k * d^-0.5, sink_h]) without the sink column;  o = p @ keys;  inverse RoPE on o's rope dims
  out = o_b_proj(concat_g(o_g @ o_a[g].T))   (grouped output projection)
SWA-only layers use the main RoPE (θ=10000, no YaRN); CSA/HCA layers the compress RoPE (θ=160000, YaRN) for q,
kv, entries and the indexer.

``AttentionBackend.SDPA`` (the fast path): on CPU the ``sink_sparse_attention`` kernel reads each query's window
and chosen entries in place; elsewhere (or with ``OPENINFER_CPU_KERNELS=0``) the torch code gathers each token's
keys from the paged stores with one index per store, in query chunks sized to bound memory. ``REFERENCE`` (see
reference.py) loops token by token, slot by slot.
"""
from __future__ import annotations

import torch
from torch import nn

from openinfer.config import AttentionBackend
from openinfer.forward_context import get_forward_context
from openinfer.layers import cpu_ops
from openinfer.distributed.parallel_state import get_tensor_model_parallel_world_size
from openinfer.layers.linear import CheckpointLinear
from openinfer.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, divide, sharded_parameter
from openinfer.layers.norm import RMSNorm, unweighted_rms_norm
from openinfer.models.deepseek_v4.cache import WINDOW, StepIndex, V4LayerCache
from openinfer.models.deepseek_v4.compressor import Compressor
from openinfer.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from openinfer.models.interface import KVStoreOwner, KVStores
from openinfer.models.deepseek_v4.indexer import Indexer
from openinfer.layers.rotary import RotaryEmbedding, apply_interleaved

# Bytes of gathered keys per query chunk in the fast path.
GATHER_BUDGET_BYTES = 256 << 20


def sink_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [T, H, d]; keys [T, L, d] (K == V); valid [T, L] -> [T, H, d]. The sink is an extra logit per head in the
    softmax denominator whose column is dropped."""
    scores = torch.einsum("thd,tld->thl", q, keys.to(q.dtype)) * scale
    # in place: scores is this function's own fresh tensor (a prefill's [T, H, L] is tens of MB per pass)
    scores = scores.float().masked_fill_(~valid[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    logits = torch.cat([scores, sink], dim=-1)
    # softmax subtracts the row max itself (the same fp32 subtraction), so no explicit shift: same bits, two
    # fewer passes
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("thl,tld->thd", probs.to(q.dtype), keys.to(q.dtype))


class DeepseekV4Attention(nn.Module, KVStoreOwner):
    def __init__(self, cfg: DeepseekV4Config, layer_idx: int,
                 backend: AttentionBackend = AttentionBackend.SDPA) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_idx = layer_idx
        self.layer_type = cfg.layer_types[layer_idx]
        self.ratio = cfg.compress_ratios[layer_idx]
        # Tensor parallel: each rank holds a slice of the query heads and of the output groups (each group's heads
        # stay on one rank); the latent K/V, the compressor and the mHC are per token, computed on every rank.
        tp = get_tensor_model_parallel_world_size()
        self.num_heads = divide(cfg.num_attention_heads, tp, "num_attention_heads")
        self.num_kv_heads = 1
        self.head_dim = cfg.head_dim
        self.sliding_window = cfg.sliding_window
        self.o_groups, self.o_lora_rank = divide(cfg.o_groups, tp, "o_groups"), cfg.o_lora_rank
        self.eps = eps
        self.scale = cfg.head_dim ** -0.5
        self.rope_type = "main" if self.layer_type == SLIDING else "compress"
        rope = cfg.main_rope if self.layer_type == SLIDING else cfg.compress_rope
        self.rotary = RotaryEmbedding(rope.rope_dim, rope.params())

        self.q_a_proj = CheckpointLinear(hidden, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, eps, torch.float32)
        self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, [cfg.num_attention_heads * self.head_dim], bias=False)
        self.kv_proj = CheckpointLinear(hidden, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, eps, torch.float32)
        self.o_a_proj = ColumnParallelLinear(cfg.num_attention_heads * self.head_dim // cfg.o_groups,
                                             [cfg.o_groups * cfg.o_lora_rank], bias=False)
        self.o_a_proj.prepack = False  # _project_out reads its weight as a grouped matrix
        self.o_b_proj = RowParallelLinear(cfg.o_groups * cfg.o_lora_rank, hidden, bias=False)
        self.sinks = sharded_parameter(cfg.num_attention_heads, dtype=torch.float32)
        self.compressor = None
        self.indexer = None
        if self.layer_type != SLIDING:
            self.compressor = Compressor(hidden, self.head_dim, self.ratio, overlap=self.layer_type == CSA, eps=eps)
        if self.layer_type == CSA:
            self.indexer = Indexer(hidden, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, self.ratio,
                                   cfg.index_topk, eps)
        self.backend = backend
        self.cache: V4LayerCache | None = None  # bound by DeepseekV4ForCausalLM.bind_kv_cache

    def kv_stores(self) -> KVStores:
        """The bound cache's stores, each in its group; none while unbound."""
        return [] if self.cache is None else self.cache.stores()

    def forward(self, x: torch.Tensor, step: StepIndex, rope: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        if self.cache is None:
            raise RuntimeError(f"layer {self.layer_idx}: no KV cache bound (bind_kv_cache not called)")
        # Every store written per token is token-level: it lives in the window group's blocks.
        slot_mapping = get_forward_context().group(WINDOW).slot_mapping
        cos, sin = rope[self.rope_type]
        t = x.shape[0]
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(t, self.num_heads, self.head_dim)
        q = apply_interleaved(unweighted_rms_norm(q, self.eps), cos, sin)
        kv = apply_interleaved(self.kv_norm(self.kv_proj(x)), cos, sin)

        cache = self.cache
        cache.flat("kv").index_copy_(0, slot_mapping, kv.to(cache.dtype))  # packs, for an fp8_ds_mla store
        if self.compressor is not None:
            self.compressor.store_rows(x, slot_mapping, cache.flat("comp"))
        if self.indexer is not None:
            self.indexer.compressor.store_rows(x, slot_mapping, cache.flat("index_comp"))

        if self.backend == AttentionBackend.REFERENCE:
            from openinfer.models.deepseek_v4.reference import reference_attention

            out = reference_attention(self, q, q_residual, x, step, cos, sin)
        else:
            self._emit_entries(step, x.dtype)
            out = torch.empty_like(q)
            chunk = self._query_chunk(step, x.element_size())
            for s in range(0, t, chunk):
                e = min(t, s + chunk)
                out[s:e] = self._attend(q[s:e], q_residual[s:e], x[s:e], step.slice(s, e), cos[s:e], sin[s:e])
        out = apply_interleaved(out, cos, sin, inverse=True)
        return self._project_out(out)

    def _emit_entries(self, step: StepIndex, dtype: torch.dtype) -> None:
        c = self.cache
        if self.compressor is not None:
            self.compressor.emit(step, c.flat("comp"), c.flat("entries"), c.entry_cap, self.rotary, dtype)
        if self.indexer is not None:
            self.indexer.compressor.emit(step, c.flat("index_comp"), c.flat("index_entries"), c.entry_cap,
                                         self.rotary, dtype)

    def _query_chunk(self, step: StepIndex, elem: int) -> int:
        keys = self.sliding_window
        if self.compressor is not None:
            keys += (step.max_position + 1) // self.ratio
        per_token = keys * (self.head_dim + (self.indexer.head_dim if self.indexer is not None else 0)) * 4
        return max(1, GATHER_BUDGET_BYTES // max(per_token, 1))

    def _attend(self, q: torch.Tensor, q_residual: torch.Tensor, x: torch.Tensor, step: StepIndex,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cache, pos = self.cache, step.positions
        seq = step.token_seq[:, None]
        windows = None
        if self.layer_type == HCA:  # every visible entry: the same windows for each HCA layer of the step
            windows = step.memo(("hca_windows", self.ratio), lambda: self._all_visible(step))
        elif self.layer_type == CSA:
            windows = self.indexer.select(q_residual, x, step, cache.flat("index_entries"), cache.entry_cap,
                                          cos, sin)
        if windows is not None and not windows.shape[1]:
            windows = None
        entry_slots = None
        if windows is not None:
            if self.layer_type == HCA:
                entry_slots = step.memo(("hca_slots", self.ratio, cache.entry_cap),
                                        lambda: step.entry_slots(seq, windows, self.ratio, cache.entry_cap))
            else:
                entry_slots = step.entry_slots(seq, windows, self.ratio, cache.entry_cap)
        # CPU kernel: the window and the chosen entries read in place, no [T, keys, d] gather
        # (fp8_ds_mla stores: the kernel widens the packed rows it reads in registers)
        out = cpu_ops.sink_sparse_attention(
            q, cache.raw("kv"), step.token_tables, step.token_seq, pos, step.block_size, self.sliding_window,
            None if windows is None else cache.raw("entries"),
            None if windows is None else torch.where(windows >= 0, entry_slots, -1), self.sinks, self.scale,
            ds_mla=cache.ds_mla)
        if out is not None:
            return out
        win_pos = pos[:, None] - (self.sliding_window - 1) + torch.arange(self.sliding_window, device=pos.device)
        keys = cache.flat("kv")[step.token_slots(seq, win_pos)]
        valid = win_pos >= 0
        if windows is not None:
            keys = torch.cat([keys, cache.flat("entries")[entry_slots]], dim=1)
            valid = torch.cat([valid, windows >= 0], dim=1)
        return sink_attention(q, keys, valid, self.sinks, self.scale)

    def _all_visible(self, step: StepIndex) -> torch.Tensor:
        """[T, max visible] entry indices of every entry each query sees, -1 past its own count."""
        pos = step.positions
        visible = (pos + 1) // self.ratio
        windows = torch.arange((step.max_position + 1) // self.ratio, device=pos.device).expand(pos.shape[0], -1)
        return torch.where(windows < visible[:, None], windows, torch.full_like(windows, -1))

    def _project_out(self, o: torch.Tensor) -> torch.Tensor:
        t, g = o.shape[0], self.o_groups
        grouped = o.reshape(t, g, -1)
        w = self.o_a_proj.weight.view(g, self.o_lora_rank, -1)
        return self.o_b_proj(torch.einsum("tgi,goi->tgo", grouped, w).reshape(t, g * self.o_lora_rank))
