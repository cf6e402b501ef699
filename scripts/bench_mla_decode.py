#!/usr/bin/env python
"""MLA decode attention for one layer: the mla_decode_attention kernel against the torch path it replaces (gather
the latent blocks padded to the longest sequence + SDPA, which runs its math fallback for head dim 576 / value
dim 512), in one process. DeepSeek-V3 shapes by default.

    python scripts/bench_mla_decode.py --batch 32 --ctx 192 --heads 8 --threads 1
"""
import argparse
import time

import torch
import torch.nn.functional as F

from openinfer.layers import cpu_ops

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--ctx", type=int, default=192)
ap.add_argument("--heads", type=int, default=8)
ap.add_argument("--threads", type=int, default=1)
a = ap.parse_args()
torch.set_num_threads(a.threads)
B, H, D, Dv, bs, L = a.batch, a.heads, 576, 512, 16, a.ctx
nb = -(-L // bs)
cache = torch.randn(B * nb + 8, bs, D)
tables = torch.randperm(B * nb).view(B, nb)
lens = torch.full((B,), L)
q = torch.randn(B, H, D)
mask = (torch.arange(nb * bs)[None] < lens[:, None])[:, None, None, :]


def kernel():
    return cpu_ops.mla_decode_attention(q, cache, tables, lens, 0.05, Dv)


def sdpa():
    kv = cache[tables].view(B, 1, -1, D)
    return F.scaled_dot_product_attention(q.unsqueeze(2), kv, kv[..., :Dv], attn_mask=mask, scale=0.05,
                                          enable_gqa=True).squeeze(2)


print("max diff", (kernel() - sdpa()).abs().max().item())
flops = B * H * L * (D + Dv) * 2
for f in (kernel, sdpa):
    f()
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    ms = sorted(ts)[len(ts) // 2]
    print(f"{f.__name__}: {ms * 1e3:.2f} ms, {flops / ms / 1e9:.1f} GFLOP/s")
