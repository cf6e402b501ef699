"""FP8 linear (``layers/fp8.py::Fp8Weight``) by activation rows: the register-tile kernel (``fp8_linear``), the
whole matrix decoded for the call then torch's fp32 GEMM (``fp8_dequantize`` + ``F.linear``, what ``matmul`` does
from ``FP8_DEQUANT_ROWS`` rows on), and a oneDNN-prepacked fp32 copy (what dequantise-at-load runs). Interleaved
rounds, best of ``--reps`` per round, median over rounds; the ratios are what sets ``FP8_DEQUANT_ROWS``.

    python scripts/fp8_rows.py --n 2048 --k 2048 --rows 1 8 32 64 128 512 --threads 1
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
    import torch.nn.functional as F

    from openinfer.layers import cpu_ops
    from openinfer.layers.fp8 import Fp8Weight, quantize_fp8_block

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    q, s = quantize_fp8_block(torch.randn(args.n, args.k) * 0.02)
    w = Fp8Weight.from_checkpoint(q, s, (128, 128))
    packed = torch.ops.mkldnn._reorder_linear_weight(w.dequantize(), 64)
    kp = w.qweight.shape[1]

    def kernel(x):
        y = torch.empty(x.shape[0], args.n)
        ops.fp8_linear(y, x, w.qweight, w.scales, w.group)

    def decoded(x):
        d = torch.empty(args.n, kp)
        ops.fp8_dequantize(d, w.qweight, w.scales, w.group)
        F.linear(x, d)

    def onednn(x):
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

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
