#!/usr/bin/env python
"""Speed of the packed GGUF linears (layers/gguf_quant.py, cpu_kernels/gguf_gemm.cpp), weights out of cache.

Per type and shape (N x K = out x in): M = 1 as GB/s of packed weight bytes, next to the copy bandwidth measured in
the same process (a 256 MiB tensor copy, read + write bytes per second as STREAM's Copy counts them, and a read-only
sum); larger M as ms per call. Enough copies of each weight are cycled through that they exceed the last-level
cache (``--stream-mib`` in all), so every call reads its weight from memory as a model's decode step does.
``--compare-int4`` adds the int4 kernel (lowbit_gemm.cpp) with group 32 on the same matrix (what Q4_0 would run
after repacking); ``--crossover`` times the register-tile kernel against decoded rows + GEMM at each M (the
GGUF_DEQUANT_ROWS choice). ``--compare-fp32`` times the int8-activation kernel (gguf_q8_gemm.cpp, the default where
the build has VNNI / AVX2) against the fp32-activation one (gguf_gemm.cpp) on the same weights, alternating calls
in the same process (``fp32 / int8`` is the speed-up), so a shared host's load moves both alike.
``--compare-tiles`` times the int8 prefill kernel (gguf_q8_tiles.cpp, GGUF_TILE_ROWS) against decoded rows + torch's
GEMM (``quant_linear.decoded_matmul``, the path before it) and, up to 64 rows, the small-M int8 kernel, alternating
calls, the minimum of ``--reps`` each (ratios are what a shared host's figures are good for).

    python scripts/gguf_gemm_speed.py --threads 1 --m 1 8 32
    python scripts/gguf_gemm_speed.py --threads 1 --m 1 4 8 16 --compare-fp32
    python scripts/gguf_gemm_speed.py --threads 2 --m 24 64 256 1024 --compare-tiles --types Q4_1 Q8_0 Q4_K Q6_K \
        --shapes 576x1536 1536x576 4096x4096
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from openinfer.layers import dispatch, gguf_quant  # noqa: E402
from openinfer.layers.gguf_quant import GGUF_TYPES, GGUFWeight, type_info  # noqa: E402
from openinfer.layers.quant_linear import QuantizedWeight  # noqa: E402

SHAPES = [(576, 1536), (1536, 576), (49152, 576), (4096, 4096)]


def random_rows(qtype: str, n: int, k: int, rng) -> torch.Tensor:
    """Random bytes with sane fp16 scales (speed does not depend on the values; NaN / inf scales are avoided)."""
    _, block, size = type_info(qtype)
    b = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    pos = {"Q6_K": [208]}.get(qtype, [0, 2] if qtype in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0])
    for p in pos:
        b[..., p:p + 2] = np.frombuffer(np.full((n, k // block), 0.01, np.float16).tobytes(), np.uint8).reshape(
            n, k // block, 2)
    return torch.from_numpy(b.reshape(n, -1))


def copy_bandwidth() -> tuple[float, float]:
    src = torch.ones(64 << 20)  # 256 MiB
    dst = torch.empty_like(src)
    best_c = best_r = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        src.sum()
        t2 = time.perf_counter()
        best_c = max(best_c, 2 * src.nbytes / (t1 - t0) / 1e9)
        best_r = max(best_r, src.nbytes / (t2 - t1) / 1e9)
    return best_c, best_r


def timed(fn_per_copy, copies: int, reps: int) -> float:
    """Median seconds per call, cycling over the copies."""
    for i in range(copies):
        fn_per_copy(i)
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        for i in range(copies):
            fn_per_copy(i)
        times.append((time.perf_counter() - t0) / copies)
    return statistics.median(times)


def compare_tiles(qtype: str, n: int, k: int, one: torch.Tensor, ws: list, copies: int, args) -> None:
    from openinfer.layers.quant_linear import decoded_matmul

    ops = dispatch.active().ops
    code = type_info(qtype)[0]
    if not ops.gguf_q8_tiled_supports(code):
        print(f"{qtype:5} {n}x{k}: no tile kernel in this build")
        return
    cols = []
    for m in args.m:
        x, y = torch.randn(m, k), torch.empty(m, n)
        use = max(1, min(copies, (64 << 20) // max(1, m * n * k // 8)))  # big calls: fewer copies, same reps
        paths = {"tiles": lambda i: ops.gguf_linear_q8_tiled(y, x, ws[i].data, code, None),
                 "decode+GEMM": lambda i: decoded_matmul(
                     x, n, lambda out, n0, n1: ops.gguf_dequantize(out, ws[i].data[n0:n1], code))}
        if m <= 64:
            paths["int8 small-M"] = lambda i: ops.gguf_linear_q8(y, x, ws[i].data, code, None)
        best = {name: float("inf") for name in paths}
        for _ in range(args.reps):  # alternating: the same load on each
            for name, fn in paths.items():
                best[name] = min(best[name], timed(fn, use, 1))
        t = best["tiles"]
        cols.append(f"M={m}: " + ", ".join(f"{name} {v * 1e3:.3f}" for name, v in best.items())
                    + f" ms; decode+GEMM / tiles {best['decode+GEMM'] / t:.2f}x")
    print(f"{qtype:5} {n}x{k} ({one.numel() / 1e6:6.2f} MB): " + "; ".join(cols), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="+", default=list(GGUF_TYPES))
    ap.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES])
    ap.add_argument("--m", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stream-mib", type=int, default=192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compare-int4", action="store_true")
    ap.add_argument("--crossover", action="store_true")
    ap.add_argument("--compare-fp32", action="store_true")
    ap.add_argument("--compare-tiles", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    c, r = copy_bandwidth()
    load = os.getloadavg()[0]  # the host is shared: figures taken under load are not the kernel's ceiling
    print(f"threads {args.threads}; copy bandwidth {c:.1f} GB/s (read + write), read-only sum {r:.1f} GB/s; "
          f"load average {load:.1f} on {os.cpu_count()} CPUs")
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        for qtype in args.types:
            _, block, _ = type_info(qtype)
            if k % block:
                print(f"{qtype:5} {n}x{k}: K not a multiple of {block} (llama.cpp stores such tensors in another type)")
                continue
            one = random_rows(qtype, n, k, rng)
            copies = max(2, (args.stream_mib << 20) // one.numel())
            ws = [GGUFWeight(qtype, one.clone(), (n, k), torch.float32) for _ in range(copies)]
            cols = []
            if args.compare_fp32:
                ops = dispatch.active().ops  # builds / loads the kernels
                code = type_info(qtype)[0]
                for m in args.m:
                    x, y = torch.randn(m, k), torch.empty(m, n)
                    t8, t32 = [], []
                    for _ in range(args.reps):  # alternating: the same load on both
                        t8.append(timed(lambda i: ops.gguf_linear_q8(y, x, ws[i].data, code, None), copies, 1))
                        t32.append(timed(lambda i: ops.gguf_linear(y, x, ws[i].data, code, None), copies, 1))
                    a, b = statistics.median(t8), statistics.median(t32)
                    cols.append(f"M={m}: int8 {a * 1e3:.3f} ms ({one.numel() / a / 1e9:.1f} GB/s), fp32 "
                                f"{b * 1e3:.3f} ms, fp32/int8 {b / a:.2f}x")
                print(f"{qtype:5} {n}x{k} ({one.numel() / 1e6:6.2f} MB): " + "; ".join(cols), flush=True)
                continue
            if args.compare_tiles:
                compare_tiles(qtype, n, k, one, ws, copies, args)
                continue
            for m in args.m:
                x = torch.randn(m, k)
                s = timed(lambda i: ws[i].matmul(x), copies, args.reps)
                cols.append(f"M={m}: {one.numel() / s / 1e9:5.1f} GB/s {s * 1e3:7.3f} ms" if m == 1 else
                            f"M={m}: {s * 1e3:7.3f} ms")
                if args.crossover and m > 1:
                    saved = gguf_quant.GGUF_DEQUANT_ROWS
                    gguf_quant.GGUF_DEQUANT_ROWS = 1 if m < saved else 10 ** 9  # the other path
                    s2 = timed(lambda i: ws[i].matmul(x), copies, args.reps)
                    gguf_quant.GGUF_DEQUANT_ROWS = saved
                    cols[-1] += f" (other path {s2 * 1e3:7.3f})"
            print(f"{qtype:5} {n}x{k} ({one.numel() / 1e6:6.2f} MB): " + "; ".join(cols), flush=True)
        if args.compare_int4:
            w = torch.randn(n, k)
            q = QuantizedWeight.quantize(w, "int4", group=32)
            copies = max(2, (args.stream_mib << 20) // q.nbytes)
            qs = [QuantizedWeight("int4", q.qweight.clone(), q.scales.clone(), (n, k), torch.float32, 32)
                  for _ in range(copies)]
            cols = []
            for m in args.m:
                x = torch.randn(m, k)
                s = timed(lambda i: qs[i].matmul(x), copies, args.reps)
                cols.append(f"M={m}: {q.nbytes / s / 1e9:5.1f} GB/s {s * 1e3:7.3f} ms" if m == 1 else
                            f"M={m}: {s * 1e3:7.3f} ms")
            print(f"int4/32 {n}x{k} ({q.nbytes / 1e6:6.2f} MB, fp32 scales): " + "; ".join(cols), flush=True)


if __name__ == "__main__":
    main()
