"""Packed linears by activation rows: the register-tile kernel (``fp8_linear`` / ``int8_linear`` / ``int4_linear``),
the matrix decoded for the call then torch's fp32 GEMM (``*_dequantize`` + ``F.linear`` in row chunks, what
``matmul`` does from ``FP8_DEQUANT_ROWS`` / ``LOWBIT_DEQUANT_ROWS`` rows on), and a oneDNN-prepacked fp32 copy (what
dequantise-at-load runs). Interleaved rounds, best of ``--reps`` per round, median over rounds; the ratios are what
set those thresholds.

    python scripts/packed_rows.py --format fp8 --n 2048 --k 2048 --rows 1 8 32 64 128 512 --threads 1
    python scripts/packed_rows.py --format int4 --n 5632 --k 1024 --rows 16 32 64 128 --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout: this checkout's openinfer, not an installed one
    sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    from openinfer.layers import cpu_ops
    from openinfer.layers.fp8 import Fp8Weight, quantize_fp8_block
    from openinfer.layers.quant_linear import QuantizedWeight, decoded_matmul

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=["fp8", "int8", "int4"], default="fp8")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 512])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_ops.get_ops()
    if ops is None:
        raise SystemExit("the CPU kernels did not build")
    dense = torch.randn(args.n, args.k) * 0.02
    if args.format == "fp8":
        w = Fp8Weight.from_checkpoint(*quantize_fp8_block(dense), (128, 128))
        kp = w.qweight.shape[1]

        def tile(y, x):
            ops.fp8_linear(y, x, w.qweight, w.scales, w.group)

        def decode(out, n0, n1):
            ops.fp8_dequantize(out, w.qweight[n0:n1], w.scales[n0:n1], w.group)
    else:
        w = QuantizedWeight.quantize(dense, args.format)
        kp = w.qweight.shape[1] * (2 if args.format == "int4" else 1)
        decode = w._decoder(ops)

        def tile(y, x):
            if args.format == "int8":
                ops.int8_linear(y, x, w.qweight, w.scales, None)
            else:
                ops.int4_linear(y, x, w.qweight, w.scales, w.group, None)
    packed = torch.ops.mkldnn._reorder_linear_weight(w.dequantize().contiguous(), 64)

    def kernel(x):
        tile(torch.empty(x.shape[0], args.n), x)

    def decoded(x):
        decoded_matmul(x, args.n, decode)

    def onednn(x):
        torch.ops.mkldnn._linear_pointwise(x[:, :args.k].contiguous(), packed, None, "none", [], "")

    print(f"{args.format} {args.n} x {args.k}")
    print(f"{'rows':>5} {'kernel ms':>10} {'decoded+GEMM ms':>16} {'oneDNN fp32 ms':>15} {'kernel/oneDNN':>14} "
          f"{'decoded/oneDNN':>15}")
    for m in args.rows:
        x = torch.randn(m, kp)
        times: dict[str, list[float]] = {}
        for r in range(args.rounds):
            fns = [("kernel", kernel), ("decoded", decoded), ("onednn", onednn)]
            for name, f in fns[r % 3:] + fns[:r % 3]:
                f(x)
                best = float("inf")
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    f(x)
                    best = min(best, time.perf_counter() - t0)
                times.setdefault(name, []).append(best)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{m:5d} {med['kernel']:10.2f} {med['decoded']:16.2f} {med['onednn']:15.2f} "
              f"{med['kernel'] / med['onednn']:14.2f} {med['decoded'] / med['onednn']:15.2f}", flush=True)


if __name__ == "__main__":
    main()
