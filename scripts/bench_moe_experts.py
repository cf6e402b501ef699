"""A/B of the routed-expert paths on rows sorted by expert (layers/moe.py), for picking the small-row threshold:
the oneDNN-prepacked per-expert loop (``_looped_packed``), the one-call kernel (``cpu_ops.moe_experts_gemv``) and
``torch._grouped_mm`` on the plain row-major stack, interleaved, median of repeats.

    nice -n 19 env OMP_NUM_THREADS=1 python scripts/bench_moe_experts.py --experts 16 --topk 4 --hidden 512 \
        --inter 256 --batches 1 8 32 64 128
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from openinfer.layers import cpu_ops, moe


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    dt = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(a.experts, 2 * a.inter, a.hidden, generator=g) * 0.05).to(dt)
    w2 = (torch.randn(a.experts, a.hidden, a.inter, generator=g) * 0.05).to(dt)
    try:
        packed = moe.pack_experts(w13, w2)
    except RuntimeError:  # oneDNN packs bf16 only with avx512bw / avx_ne_convert: the kernel vs grouped_mm then
        packed = None
    assert cpu_ops.available()
    print(f"threads {torch.get_num_threads()}  E {a.experts} top-{a.topk} H {a.hidden} I {a.inter} {a.dtype}")
    print("batch rows | packed us | kernel us | grouped_mm us | kernel/packed | grouped/packed")
    for b in a.batches:
        ids = torch.stack([torch.randperm(a.experts, generator=g)[:a.topk] for _ in range(b)])
        counts = torch.bincount(ids.reshape(-1), minlength=a.experts).tolist()
        rows = torch.randn(b * a.topk, a.hidden, generator=g).to(dt)
        fns = {
            "packed": (lambda: moe._looped_packed(rows, packed, counts, None)) if packed else (lambda: None),
            "kernel": lambda: cpu_ops.moe_experts_gemv(rows, counts, w13, w2, None),
            "grouped": lambda: moe._grouped(rows, counts, w13, w2, None),
        }
        times = {k: [] for k in fns}
        for _ in range(a.rounds):  # interleaved: each round times every path once
            for k, f in fns.items():
                f()
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    f()
                times[k].append((time.perf_counter() - t0) / a.iters * 1e6)
        med = {k: statistics.median(v) for k, v in times.items()}
        spread = {k: (max(v) - min(v)) / med[k] * 100 for k, v in times.items()}
        print(f"{b:5d} {len(rows):4d} | {med['packed']:8.1f} ±{spread['packed']:.0f}% | {med['kernel']:8.1f} "
              f"±{spread['kernel']:.0f}% | {med['grouped']:8.1f} ±{spread['grouped']:.0f}% | "
              f"{med['kernel'] / med['packed']:.2f} | {med['grouped'] / med['packed']:.2f}")


if __name__ == "__main__":
    main()
