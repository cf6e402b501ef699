#!/usr/bin/env python
"""MLA decode attention for one layer: the mla_decode_attention kernel against the torch path it replaces (gather
the latent blocks padded to the longest sequence + SDPA, which runs its math fallback for head dim 576 / value
dim 512), in one process. DeepSeek-V3 shapes by default.

    python scripts/bench_mla_decode.py --batch 32 --ctx 192 --heads 8 --threads 1
    python scripts/bench_mla_decode.py --batch 64 --kv-cache-dtype auto,fp8 --dtype bfloat16

With ``--kv-cache-dtype auto,fp8`` it times the kernel alone over the same latents stored in ``--dtype`` and in
float8_e4m3fn (kv_cache_dtype fp8), interleaved round by round: medians, min..max, and the per-round ratio.
"""
import argparse
import time

import torch
import torch.nn.functional as F

from openinfer.layers import cpu_ops
from openinfer.layers.kv_quant import FP8_DTYPE, to_cache

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--ctx", type=int, default=192)
ap.add_argument("--heads", type=int, default=8)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--dtype", default="float32")
ap.add_argument("--kv-cache-dtype", default=None, help="comma list, e.g. auto,fp8")
ap.add_argument("--rounds", type=int, default=7)
a = ap.parse_args()
torch.set_num_threads(a.threads)
B, H, D, Dv, bs, L = a.batch, a.heads, 576, 512, 16, a.ctx
nb = -(-L // bs)
dt = getattr(torch, a.dtype)
cache = torch.randn(B * nb + 8, bs, D).to(dt)
tables = torch.randperm(B * nb).view(B, nb)
lens = torch.full((B,), L)
q = torch.randn(B, H, D).to(dt)
mask = (torch.arange(nb * bs)[None] < lens[:, None])[:, None, None, :]


def kernel():
    return cpu_ops.mla_decode_attention(q, cache, tables, lens, 0.05, Dv)


def sdpa():
    kv = cache[tables].view(B, 1, -1, D)
    return F.scaled_dot_product_attention(q.unsqueeze(2), kv, kv[..., :Dv], attn_mask=mask, scale=0.05,
                                          enable_gqa=True).squeeze(2)


if a.kv_cache_dtype:
    kinds = a.kv_cache_dtype.split(",")
    caches = {k: cache if k == "auto" else to_cache(cache, FP8_DTYPE) for k in kinds}
    times = {k: [] for k in kinds}
    for k in kinds:  # warm-up
        cpu_ops.mla_decode_attention(q, caches[k], tables, lens, 0.05, Dv)
    for _ in range(a.rounds):
        for k in kinds:
            t = time.perf_counter()
            for _ in range(3):
                cpu_ops.mla_decode_attention(q, caches[k], tables, lens, 0.05, Dv)
            times[k].append((time.perf_counter() - t) / 3)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    ratios = sorted(times[kinds[0]][i] / times[kinds[-1]][i] for i in range(a.rounds))
    print(f"MLA decode kernel, q {a.dtype}, B={B} H={H} ctx={L} {a.threads} threads, {a.rounds} interleaved rounds: "
          + ", ".join(f"{k} ({caches[k].element_size()} B/elem) {med[k] * 1e3:.2f} ms "
                      f"({min(times[k]) * 1e3:.2f}..{max(times[k]) * 1e3:.2f})" for k in kinds)
          + f"; {kinds[0]}/{kinds[-1]} per round median {ratios[len(ratios) // 2]:.2f}x "
            f"({ratios[0]:.2f}..{ratios[-1]:.2f})")
    raise SystemExit(0)

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
