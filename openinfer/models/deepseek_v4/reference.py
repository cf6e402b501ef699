"""Plain reference path for V4 attention (``backend == "reference"``): token by token, slot by slot, in fp32.

Written independently of the vectorised path (Python ints for slots, explicit exp/sum softmax with the sink,
Python ``sorted`` for the indexer's top-k) so that the fast path can be tested against it. Slow by design.
"""
from __future__ import annotations

import torch

from openinfer.models.deepseek_v4.cache import StepIndex
from openinfer.models.deepseek_v4.compressor import Compressor
from openinfer.models.deepseek_v4.config import CSA, HCA
from openinfer.layers.rotary import RotaryEmbedding, apply_interleaved


def _row_reader(store: torch.Tensor, table: list[int], block_size: int):
    return lambda pos: store[table[pos // block_size] * block_size + pos % block_size]


def _entry_slot(step: StepIndex, row: int, w: int, ratio: int, cap: int) -> int:
    if step.coarse_tables is not None and ratio == step.coarse_tokens:  # one coarse block per entry
        return int(step.coarse_tables[row, w])
    end = (w + 1) * ratio - 1
    return int(step.tables[row, end // step.block_size]) * cap + (end % step.block_size) // ratio


def reference_emit(comp: Compressor, step: StepIndex, store: torch.Tensor, entries: torch.Tensor, cap: int,
                   rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
    m, d, bs = comp.ratio, comp.dim, step.block_size
    width = comp.kv_proj.out_features
    for t in range(step.positions.shape[0]):
        p = int(step.positions[t])
        if (p + 1) % m:
            continue
        seq = int(step.token_seq[t])
        row = _row_reader(store, step.token_tables[seq].tolist(), bs)
        start = p - m + 1
        kvs, gates = [], []
        if comp.overlap and start >= m:  # the previous window's "Ca" half; window 0 simply has none
            for j in range(m):
                r = row(start - m + j).float()
                kvs.append(r[:d])
                gates.append(r[width:width + d] + comp.position_bias[j, :d])
        lo = d if comp.overlap else 0  # this window's "Cb" half (or its only half)
        for j in range(m):
            r = row(start + j).float()
            kvs.append(r[lo:lo + d])
            gates.append(r[width + lo:width + lo + d] + comp.position_bias[j, lo:lo + d])
        g = torch.stack(gates)
        e = torch.exp(g - g.max(dim=0).values)
        pooled = (torch.stack(kvs) * (e / e.sum(dim=0))).sum(dim=0)
        entry = comp.kv_norm(pooled.to(dtype)[None])
        cos, sin = rotary.cos_sin(torch.tensor([start], device=store.device))
        entries[_entry_slot(step, seq, start // m, m, cap)] = apply_interleaved(entry, cos, sin)[0].to(entries.dtype)


def reference_attention(attn, q: torch.Tensor, q_residual: torch.Tensor, x: torch.Tensor, step: StepIndex,
                        cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """attn: a DeepseekV4Attention whose new tokens' rows are already stored. Emits this step's entries, then
    attends query by query. Returns [T, H, d]."""
    cache, bs, m = attn.cache, step.block_size, attn.ratio
    if attn.compressor is not None:
        reference_emit(attn.compressor, step, cache.flat("comp"), cache.flat("entries"), cache.entry_cap,
                       attn.rotary, x.dtype)
    if attn.indexer is not None:
        reference_emit(attn.indexer.compressor, step, cache.flat("index_comp"), cache.flat("index_entries"),
                       cache.entry_cap, attn.rotary, x.dtype)
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        p = int(step.positions[t])
        seq = int(step.token_seq[t])
        row = _row_reader(cache.flat("kv"), step.token_tables[seq].tolist(), bs)
        keys = [row(pos) for pos in range(max(0, p - attn.sliding_window + 1), p + 1)]
        visible = (p + 1) // m if m else 0
        chosen: list[int] = []
        if attn.layer_type == HCA:
            chosen = list(range(visible))
        elif attn.layer_type == CSA and visible:
            idx = attn.indexer
            qi, head_w = idx.query(q_residual[t:t + 1], x[t:t + 1], cos[t:t + 1], sin[t:t + 1])
            partial = []
            for w in range(visible):
                k = cache.flat("index_entries")[_entry_slot(step, seq, w, m, cache.entry_cap)].float()
                per_head = torch.relu(qi[0].float() @ k) * idx.head_dim ** -0.5
                partial.append((per_head * head_w[0]).sum())
            scores = idx.tp.all_reduce(torch.stack(partial)).tolist()  # this rank's heads, summed over ranks
            chosen = sorted(range(visible), key=lambda w: (-scores[w], w))[:idx.topk]
        for w in chosen:
            keys.append(cache.flat("entries")[_entry_slot(step, seq, w, m, cache.entry_cap)])
        k = torch.stack(keys).float()  # [L, d]
        logits = (q[t].float() @ k.t()) * attn.scale  # [H, L]
        sinks = attn.sinks.float()
        top = torch.maximum(logits.max(dim=-1).values, sinks)
        e = torch.exp(logits - top[:, None])
        probs = e / (e.sum(dim=-1) + torch.exp(sinks - top))[:, None]
        out[t] = (probs @ k).to(q.dtype)
    return out
