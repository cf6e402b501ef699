"""bf16 linears on oneDNN's prepacked layout against the AVX512-BF16 pair-panel kernel (``pair_panel_gemm.cpp``),
interleaved in one process, at several row counts: every dense linear of issue 38's DeepSeek-V3 shape (hidden 768,
6 MLA layers, 5 MoE layers' shared expert, the first layer's dense MLP, a 32000-row LM head: 101 MB of bf16), each
weight once per step, so the weights stream from memory as in a decode step.

    python scripts/pair_panel_speed.py --rows 1 4 8 16 32 128 512

GB/s counts the weight bytes once per step; GFLOP/s 2 * rows * weights. Needs a build with AVX512-BF16.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from openinfer.layers import cpu_ops, dispatch

# name: ((out, in), how many)
SHAPES = {"q_a": ((384, 768), 6), "q_b": ((2304, 384), 6), "kv_a": ((576, 768), 6), "o": ((768, 1536), 6),
          "shared_gate_up": ((768, 768), 5), "shared_down": ((768, 384), 5), "mlp_gate_up": ((4096, 768), 1),
          "mlp_down": ((768, 2048), 1), "lm_head": ((32000, 768), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 128, 512])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if not dispatch.active().pair_panels_built:
        raise SystemExit("this build has no AVX512-BF16 pair-panel kernel")
    g = torch.Generator().manual_seed(0)
    ws = {n: [(torch.randn(*shape, generator=g) * 0.05).bfloat16() for _ in range(k)]
          for n, (shape, k) in SHAPES.items()}
    packed = {n: [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in l] for n, l in ws.items()}
    pairs = {n: [cpu_ops.pack_pair_panels(w.unsqueeze(0)) for w in l] for n, l in ws.items()}
    total = sum(w.nbytes for l in ws.values() for w in l)
    print(f"threads {a.threads}; {total / 1e6:.1f} MB of bf16 weights")
    for m in a.rows:
        xs = {n: torch.randn(m, SHAPES[n][0][1], generator=g).bfloat16() for n in SHAPES}

        def onednn():
            for n, l in packed.items():
                for w in l:
                    torch.ops.mkldnn._linear_pointwise(xs[n], w, None, "none", [], "")

        def pair():
            for n, l in pairs.items():
                for w in l:
                    cpu_ops.pair_panel_linear(xs[n], w, SHAPES[n][0][0])

        reps = max(1, 20 // max(1, m // 16))
        times: dict[str, list[float]] = {"oneDNN": [], "pair": []}
        for _ in range(a.rounds):
            for name, f in (("oneDNN", onednn), ("pair", pair)):
                f()
                t0 = time.perf_counter()
                for _ in range(reps):
                    f()
                times[name].append((time.perf_counter() - t0) / reps)
        to, tp = statistics.median(times["oneDNN"]), statistics.median(times["pair"])
        fl = total * m  # 2 flops per bf16 weight (2 bytes) per row
        print(f"rows {m:4d}: oneDNN packed {to * 1e3:7.2f} ms ({total / to / 1e9:5.1f} GB/s, {fl / to / 1e9:4.0f} "
              f"GFLOP/s) | pair panels {tp * 1e3:7.2f} ms ({total / tp / 1e9:5.1f} GB/s, {fl / tp / 1e9:4.0f} "
              f"GFLOP/s) | pair / oneDNN {tp / to:.2f}", flush=True)


if __name__ == "__main__":
    main()
