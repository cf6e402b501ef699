#!/usr/bin/env python
"""One DeepSeek-V4 attention layer at the shape of a batch-32 x 128-token prefill (16 heads x 128, window 128, up to
32 compressed entries per query): the sink_sparse_attention kernel against the torch path it replaces (gather
every query's window + entries, then sink_attention), in one process, 1 thread.

    python scripts/bench_v4_attention.py
"""
import time

import torch

from openinfer.layers import cpu_ops
from openinfer.models.deepseek_v4.attention import sink_attention
torch.set_num_threads(1)
S, L, H, d, W, bs, E = 32, 128, 16, 128, 128, 16, 32
nb = L // bs
tables = torch.randperm(S * nb).view(S, nb)
kv = torch.randn(S * nb * bs, d)
entries = torch.randn(S * 8 + 8, d)
token_seq = torch.arange(S).repeat_interleave(L)
pos = torch.arange(L).repeat(S)
T = S * L
vis = (pos + 1) // 4
w = torch.arange(E)[None].expand(T, -1)
slots = torch.where(w < vis[:, None], token_seq[:, None] * 8 + (w % 8), torch.full_like(w, -1))
q = torch.randn(T, H, d)
sinks = torch.randn(H)
def kernel():
    return cpu_ops.sink_sparse_attention(q, kv, tables, token_seq, pos, bs, W, entries, slots, sinks, d ** -0.5)
def torch_path():
    out = torch.empty_like(q)
    chunk = 2048
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        p = pos[s:e]
        sq = token_seq[s:e, None]
        win_pos = p[:, None] - (W - 1) + torch.arange(W)
        wp = win_pos.clamp(min=0)
        keys = kv[tables[sq, wp // bs] * bs + wp % bs]
        valid = win_pos >= 0
        keys = torch.cat([keys, entries[slots[s:e].clamp(min=0)]], 1)
        valid = torch.cat([valid, slots[s:e] >= 0], 1)
        out[s:e] = sink_attention(q[s:e], keys, valid, sinks, d ** -0.5)
    return out
print("max diff", (kernel() - torch_path()).abs().max().item())
for f in (kernel, torch_path, kernel, torch_path):
    t = time.perf_counter()
    f()
    print(f.__name__, round(time.perf_counter() - t, 3), "s")
