#!/usr/bin/env python
"""GFLOP/s of one linear on the 16-column panel layout (``cpu_kernels/panel_gemm.cpp``) against the layouts it
replaces: oneDNN's prepacked weight (fp32; bf16 where the CPU has native bf16), the row-major gemv kernel and
torch's F.linear. Weights are cycled through ~``--mb`` MB so each call streams them from memory, as a decode step
does; best of ``--rounds`` passes per point.

    python scripts/panel_gemm_speed.py --dtype float32 --shapes 32000x512 2048x512 8192x4096 --m 1 8 16 32 512
    python scripts/panel_gemm_speed.py --dtype bfloat16 --shapes 5632x1024 --m 1 8 32 128
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--shapes", nargs="+", default=["32000x512", "2048x512", "8192x4096"], help="NxK")
    ap.add_argument("--m", nargs="+", type=int, default=[1, 8, 16, 32, 64, 512])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mb", type=float, default=160.0, help="weight bytes cycled through per pass")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from openinfer.layers import cpu_ops
    from openinfer.platform import cpu_has_fast_bf16

    dtype = getattr(torch, args.dtype)
    if cpu_ops.get_ops() is None:
        raise SystemExit("the CPU kernels did not build here")
    onednn = dtype == torch.float32 or cpu_has_fast_bf16()
    print(f"dtype {args.dtype}, {args.threads} thread(s), weights cycled through {args.mb:.0f} MB; GFLOP/s")
    print("| N x K | M | panels | oneDNN packed | gemv (row-major) | F.linear | panels / best other |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        reps = max(1, int(args.mb * 1e6 // (n * k * dtype.itemsize)))
        ws = [torch.randn(n, k).to(dtype) for _ in range(reps)]
        panels = [cpu_ops.pack_panels(w) for w in ws]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws] if onednn else None
        for m in args.m:
            x = torch.randn(m, k).to(dtype)
            ways = {
                "panels": lambda: [cpu_ops.panel_gemm(x, p, n) for p in panels],
                "oneDNN packed": (lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                           for p in packed]) if packed else None,
                "gemv (row-major)": lambda: [cpu_ops.dense_gemv(x, w, None) for w in ws],
                "F.linear": lambda: [F.linear(x, w) for w in ws],
            }
            gf = {}
            for name, fn in ways.items():
                if fn is None:
                    continue
                fn()  # warm
                best = min(_timed(fn) for _ in range(args.rounds)) / reps
                gf[name] = 2 * m * n * k / best / 1e9
            others = max(v for name, v in gf.items() if name != "panels")
            cells = " | ".join(f"{gf[name]:.1f}" if name in gf else "-" for name in ways)
            print(f"| {n} x {k} | {m} | {cells} | {gf['panels'] / others:.2f}x |", flush=True)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
