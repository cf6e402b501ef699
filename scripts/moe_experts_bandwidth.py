#!/usr/bin/env python
"""The routed-expert kernel (``cpu_ops.moe_experts_gemv``) against the copy bandwidth (issue 38): per batch, one
call per MoE layer over ``--layers`` distinct expert stacks (so the weights come from memory, not from the last
level cache, as in a decode step), the expert weight bytes it streams per second (only experts with rows count:
each of their gate / up / down bytes once), next to the copy bandwidth measured in the same process, interleaved.
Where the build has AVX512-BF16 both of the kernel's bf16 paths run, interleaved round by round: ``fma`` (weights
widened to fp32, FMAs; what ran before issue 38 and what AVX2 builds run) and ``dot`` (vdpbf16ps).

    nice -n 19 python scripts/moe_experts_bandwidth.py --threads 2 --batches 1 8 32

Defaults are the DeepSeek-V3-shaped 229M model of issue 38: 32 experts top-6, hidden 768, expert intermediate 384,
5 MoE layers (283 MB of bf16 experts). Copy bandwidth counts bytes read + bytes written (STREAM's Copy), as
scripts/decode_bandwidth.py does. GFLOP/s counts 2 * 3 * H * I per (token, expert) pair; with weights that stay in
cache (``--experts 1 --topk 1 --layers 1 --batches 192``: one 1.8 MB expert with 192 rows) it is the kernel's
arithmetic rate alone.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout under test, not an installed copy

from openinfer.layers import cpu_ops  # noqa: E402


def copy_gbs(src: torch.Tensor, dst: torch.Tensor) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return 2 * src.nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--inter", type=int, default=384)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10, help="passes over all layers per round")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    assert cpu_ops.available(), "the CPU kernels did not build"
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    stacks = [((torch.randn(a.experts, 2 * a.inter, a.hidden, generator=g) * 0.05).to(dt),
               (torch.randn(a.experts, a.hidden, a.inter, generator=g) * 0.05).to(dt)) for _ in range(a.layers)]
    per_expert = 3 * a.hidden * a.inter * 2
    src = torch.ones(64 << 20)  # 256 MiB, as scripts/gguf_gemm_speed.py
    dst = torch.empty_like(src)
    print(f"threads {a.threads}; E {a.experts} top-{a.topk} H {a.hidden} I {a.inter} bf16, {a.layers} layers "
          f"({a.layers * a.experts * per_expert / 1e6:.0f} MB of experts)")
    ops = cpu_ops.get_ops()
    paths = {"fma": False, "dot": True} if ops.moe_bf16_dot() else {"fma": False}
    print("batch rows active/layer | path | ms per step (all layers) | expert GB/s | copy GB/s | % of copy | GFLOP/s")
    for b in a.batches:
        calls = []
        for w13, w2 in stacks:  # each layer its own routing
            ids = torch.stack([torch.randperm(a.experts, generator=g)[:a.topk] for _ in range(b)])
            counts = torch.bincount(ids.reshape(-1), minlength=a.experts)
            rows = torch.randn(b * a.topk, a.hidden, generator=g).to(dt)
            calls.append((torch.empty_like(rows), rows, counts, w13, w2))
        active = sum(int((c[2] > 0).sum()) for c in calls)
        streamed = active * per_expert
        step_ms = {p: [] for p in paths}
        copies = []
        for _ in range(a.rounds):  # interleaved: a copy, then each path's steps
            copies.append(copy_gbs(src, dst))
            for p, flag in paths.items():
                for c in calls:
                    ops.moe_experts_gemv(*c, float("inf"), flag)
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    for c in calls:
                        ops.moe_experts_gemv(*c, float("inf"), flag)
                step_ms[p].append((time.perf_counter() - t0) / a.steps * 1e3)
        cp = statistics.median(copies)
        for p, ts in step_ms.items():
            ms = statistics.median(ts)
            gb = streamed / (ms / 1e3) / 1e9
            print(f"{b:5d} {b * a.topk:4d} {active / a.layers:6.1f} | {p} | {ms:8.2f} (min {min(ts):.2f}, max "
                  f"{max(ts):.2f}) | {gb:6.1f} | {cp:6.1f} | {gb / cp * 100:5.1f} % | "
                  f"{2 * 3 * a.hidden * a.inter * b * a.topk * a.layers / (ms / 1e3) / 1e9:6.1f}")

if __name__ == "__main__":
    main()
