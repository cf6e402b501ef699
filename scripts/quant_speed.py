"""Decode speed of ``--quantization int8 / int4 / w8a8 / w4a8`` against the unquantised weights, in one process,
interleaved (issue 16, build item "low-bit weights"; the box is shared, so only ratios measured side by side mean much).

One engine per mode is loaded up front; then for each round and batch size every mode runs one timed decode
window (``bench/decode_window.py``: prefill untimed, then exactly ``--steps`` pure decode steps), the modes in
rotating order. Reported per mode and batch: median decode tok/s over the rounds with its min-max, the ratio to
the unquantised median, and at batch 1 the weight bytes streamed per second (the bytes of every linear layer,
LM head included, read once per step; the embedding is a lookup and is not counted).

    python scripts/make_bench_checkpoint.py
    python scripts/quant_speed.py --model .bench/llama-200m --batches 1 8 32 --rounds 3
    python scripts/quant_speed.py --microbench --batches 1 8 32 --rounds 5   # one layer's linears only
    python scripts/quant_speed.py --microbench --modes int4 int4-zp --batches 1 32   # the zero-point correction
    python scripts/quant_speed.py --model .bench/llama-200m --modes int8 w8a8 ct-w8a8=/tmp/llama-200m-w8a8

A mode is a ``--quantization`` method (``none``: unquantised), or ``NAME=PATH``: a low-bit checkpoint
(``scripts/make_quantized_checkpoint.py``) of the same weights, loaded as it is.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics


def linear_bytes(model) -> int:
    from openinfer.layers.linear import Linear

    total = 0
    for m in model.modules():
        if isinstance(m, Linear):
            if m._quant is not None:
                total += m._quant.nbytes
            else:
                elem = m._packed.element_size() if m._packed is not None else m.weight.element_size()
                total += m.in_features * m.out_features * elem
    return total


def microbench(batches: list[int], rounds: int, modes: list[str]) -> None:
    """``--microbench``: the bench checkpoint's four linear shapes (summed per layer), one Linear each per mode,
    timed interleaved: min over rounds of the median of 5 calls, per M. Fewer moving parts than an engine step."""
    import time

    import torch

    from openinfer.layers.linear import Linear
    from openinfer.layers.quant_linear import QuantizedWeight

    shapes = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)]  # qkv, o, gate_up, down: (N, K)
    torch.manual_seed(0)
    layers = {}
    for mode in modes:
        ls = []
        for n, k in shapes:
            lin = Linear(k, n, bias=False)
            if mode == "none":
                lin.prepack_cpu()
            elif mode == "int4-zp":  # int4 with per-group zero points, as AWQ / asymmetric GPTQ checkpoints load
                lin.quantize("int4")
                q = lin._quant
                lin._quant = QuantizedWeight("int4", q.qweight, q.scales, tuple(q.shape), q.dtype, q.group,
                                             (q.scales * torch.randint(-7, 9, q.scales.shape)).t().contiguous())
            else:
                lin.quantize(mode)
            ls.append(lin)
        layers[mode] = ls
    print(f"{'M':>4} " + " ".join(f"{m + ' ms':>10}" for m in layers) + "   speed-up vs " + modes[0])
    for m in batches:
        xs = [torch.randn(m, k) for _, k in shapes]
        best = {mode: float("inf") for mode in layers}
        for _ in range(rounds):
            for mode, ls in layers.items():
                ts = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    for lin, x in zip(ls, xs):
                        lin(x)
                    ts.append(time.perf_counter() - t0)
                best[mode] = min(best[mode], sorted(ts)[2])
        print(f"{m:4d} " + " ".join(f"{best[mode] * 1e3:10.3f}" for mode in layers) + "   "
              + " ".join(f"{mode} {best[modes[0]] / best[mode]:.2f}x" for mode in modes[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--microbench", action="store_true", help="time one layer's linears per mode instead")
    ap.add_argument("--modes", nargs="+", default=["none", "int8", "int4"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--context-len", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if args.microbench:
        return microbench(args.batches, args.rounds, args.modes)
    if args.model is None:
        ap.error("--model is required (or --microbench)")

    from openinfer import LLM
    from openinfer.bench.decode_window import run_decode_window

    engines, nbytes = {}, {}
    for mode in args.modes:
        path = mode.partition("=")[2] or args.model
        quant = None if mode == "none" or "=" in mode else mode
        llm = LLM(model=path, quantization=quant, dtype=args.dtype,
                  max_num_seqs=max(args.batches), max_model_len=args.context_len + args.steps * 4 + 64,
                  num_kv_blocks=max(args.batches) * (-(-(args.context_len + args.steps * 4 + 64) // 16)) + 8)
        engines[mode] = llm.engine
        nbytes[mode] = linear_bytes(llm.engine.core.executor.driver_worker.model)
        print(f"{mode}: linear weights {nbytes[mode] / 1e6:.1f} MB ({llm.engine.config.model.dtype})", flush=True)
    rng = random.Random(0)
    vocab = engines[args.modes[0]].config.model.vocab_size
    samples: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for b in args.batches:
            prompts = [[rng.randrange(3, vocab) for _ in range(args.context_len)] for _ in range(b)]
            order = args.modes[r % len(args.modes):] + args.modes[:r % len(args.modes)]
            for mode in order:
                s = run_decode_window(engines[mode], prompts, args.steps, 0.0).sample
                samples.setdefault((mode, b), []).append(s.num_output_tokens / s.elapsed_s)
            print(f"round {r} batch {b}: " + ", ".join(f"{m} {samples[(m, b)][-1]:.1f}" for m in args.modes),
                  flush=True)
    rows = []
    print(f"\n{'mode':10} {'batch':>5} {'tok/s median':>12} {'min-max':>15} {'x none':>7} {'weight GB/s':>11}")
    for b in args.batches:
        base = statistics.median(samples[(args.modes[0], b)])
        for mode in args.modes:
            xs = samples[(mode, b)]
            med = statistics.median(xs)
            gbs = med / b * nbytes[mode] / 1e9 if b == 1 else None
            rows.append({"mode": mode, "batch": b, "tok_s": xs, "median": med, "ratio": med / base,
                         "weight_gb_s": gbs, "linear_bytes": nbytes[mode]})
            print(f"{mode:10} {b:5d} {med:12.1f} {min(xs):7.1f}-{max(xs):<7.1f} {med / base:7.2f} "
                  + (f"{gbs:11.2f}" if gbs is not None else ""))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    main()
