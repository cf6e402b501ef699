#!/usr/bin/env python
"""Batch-1 decode against the memory bandwidth (issue 16, must-show 3): the weight bytes a decode step streams per
second, next to the copy bandwidth measured in the same process, interleaved.

Per thread count and round: one large tensor copy (copy bandwidth = bytes read + bytes written per second, as
STREAM's "Copy" counts it; a read-only sum is printed beside it), then one timed batch-1 decode window
(``bench/decode_window.py``: prefill untimed, then exactly ``--steps`` decode steps) per configuration, in rotating
order. Streamed bytes per step = the bytes of every linear layer's weight, LM head included (each is read once per
step at batch 1; the embedding is a one-row lookup and is not counted). Configurations:

- ``fp32-packed``: fp32, oneDNN-packed weights (the default layout for fp32);
- ``fp32-rowmajor`` / ``fp32-rowmajor-nogemv``: fp32 with ``OPENINFER_CPU_PREPACK=0`` (the low-latency mode),
  with the gemv kernel and without it (``F.linear``, the path before the kernel);
- ``bf16`` / ``bf16-nogemv``: bf16 weights with the kernel and without it (torch's bf16 GEMM);
- ``w8a8`` / ``w4a8``: ``--quantization w8a8`` / ``w4a8`` (int8 / 4-bit weights times int8 activations); their
  streamed bytes are the packed weights and scales as resident (``QuantizedWeight.nbytes``), the LM head included.

Each engine is loaded once; "-nogemv" reuses its engine with the gemv kernel off for that window (its kernel
selection's ``gemv`` switch, ``set_gemv`` below; that switch
reaches the linears on the Python path: every one with row-major fp32, only the LM head where the Llama decode-layer
op takes the layers, which runs its own kernel).

    python scripts/make_bench_checkpoint.py --out /work/bench/llama-200m
    python scripts/decode_bandwidth.py --model /work/bench/llama-200m --threads 1 2 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

# the checkout this script is in, not whichever openinfer is installed (``python scripts/x.py`` puts scripts/ on
# sys.path, not the repository root): a before/after comparison must run the code under test
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = {  # name -> (dtype, OPENINFER_CPU_PREPACK, gemv, quantization)
    "fp32-packed": ("float32", "1", True, None),
    "fp32-rowmajor": ("float32", "0", True, None),
    "fp32-rowmajor-nogemv": ("float32", "0", False, None),
    "bf16": ("bfloat16", "1", True, None),
    "bf16-nogemv": ("bfloat16", "1", False, None),
    "w8a8": ("float32", "1", True, "w8a8"),
    "w4a8": ("float32", "1", True, "w4a8"),
}


def engine_key(name: str) -> tuple:
    """The engine a configuration runs on: (dtype, prepack, quantization); the gemv switch reuses one engine."""
    dtype, prepack, _, quant = CONFIGS[name]
    return dtype, prepack, quant


def linear_bytes(model) -> int:
    from openinfer.layers.linear import Linear

    total = 0
    for m in model.modules():
        if isinstance(m, Linear) and m._quant is not None:
            total += m._quant.nbytes
        elif isinstance(m, Linear):
            elem = m._packed.element_size() if m._packed is not None else m.weight.element_size()
            total += m.in_features * m.out_features * elem
    return total


def set_gemv(engine, on: bool) -> None:
    """The gemv kernel on or off for this engine's next steps: its kernel selection (layers/dispatch.py, made at
    load and in force for every step) with the ``gemv`` switch replaced."""
    import dataclasses

    runner = engine.core.executor.driver_worker.model_runner
    kernels = runner.kernels
    runner.kernels = dataclasses.replace(kernels, config=dataclasses.replace(kernels.config, gemv=on))


def copy_bandwidth(src, dst) -> tuple[float, float]:
    """(copy GB/s counting read + write, read-only GB/s of a sum) over ``src``."""
    t0 = time.perf_counter()
    dst.copy_(src)
    t1 = time.perf_counter()
    src.sum()
    t2 = time.perf_counter()
    n = src.numel() * src.element_size()
    return 2 * n / (t1 - t0) / 1e9, n / (t2 - t1) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/work/bench/llama-200m")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--context-len", type=int, default=32)
    ap.add_argument("--copy-mb", type=int, default=512, help="size of the copied tensor")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    import torch

    from openinfer import LLM
    from openinfer.bench.decode_window import run_decode_window

    max_len = args.context_len + args.steps * 2 + 64
    engines, nbytes = {}, {}
    for name in args.configs:
        key = engine_key(name)
        dtype, prepack, quant = key
        if key not in engines:
            os.environ["OPENINFER_CPU_PREPACK"] = prepack  # read when the weights are packed, at load
            llm = LLM(model=args.model, dtype=dtype, max_num_seqs=1, max_model_len=max_len,
                      num_kv_blocks=-(-max_len // 16) + 4, quantization=quant)
            engines[key] = llm.engine
            nbytes[key] = linear_bytes(llm.engine.core.executor.driver_worker.model)
            print(f"{dtype} prepack={prepack} quantization={quant}: linear weights {nbytes[key] / 1e6:.1f} MB",
                  flush=True)
    os.environ.pop("OPENINFER_CPU_PREPACK", None)
    src = torch.randn(args.copy_mb * 2 ** 20 // 4)
    dst = torch.empty_like(src)
    vocab = next(iter(engines.values())).config.model.vocab_size
    rng = random.Random(0)
    samples: dict[tuple[str, int], list[float]] = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.configs:  # warm-up: first-touch pages, the kernel build, oneDNN's primitive caches
            set_gemv(engines[engine_key(name)], CONFIGS[name][2])
            run_decode_window(engines[engine_key(name)],
                              [[rng.randrange(3, vocab) for _ in range(args.context_len)]], 4, 0.0)
        copy_bandwidth(src, dst)
        for r in range(args.rounds):
            c, rd = copy_bandwidth(src, dst)
            samples.setdefault(("copy", threads), []).append(c)
            samples.setdefault(("read", threads), []).append(rd)
            order = args.configs[r % len(args.configs):] + args.configs[:r % len(args.configs)]
            prompt = [rng.randrange(3, vocab) for _ in range(args.context_len)]
            for name in order:
                key = engine_key(name)
                set_gemv(engines[key], CONFIGS[name][2])
                s = run_decode_window(engines[key], [prompt], args.steps, 0.0).sample
                samples.setdefault((name, threads), []).append(nbytes[key] * args.steps / s.elapsed_s / 1e9)
            print(f"threads {threads} round {r}: copy {c:.1f} GB/s, "
                  + ", ".join(f"{n} {samples[(n, threads)][-1]:.1f}" for n in args.configs), flush=True)
        for engine in engines.values():
            set_gemv(engine, True)
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} (cores: {os.cpu_count()})")
    print(f"{'threads':>7} {'what':22} {'GB/s median':>11} {'min-max':>13} {'% of copy':>9} {'tok/s':>7}")
    rows = []
    for threads in args.threads:
        copy = statistics.median(samples[("copy", threads)])
        for name in ["copy", "read", *args.configs]:
            xs = samples[(name, threads)]
            med = statistics.median(xs)
            tok_s = None
            if name in CONFIGS:
                tok_s = med * 1e9 / nbytes[engine_key(name)]
            rows.append({"threads": threads, "what": name, "gb_s": xs, "median": med, "of_copy": med / copy,
                         "tok_s": tok_s})
            print(f"{threads:7d} {name:22} {med:11.2f} {min(xs):6.2f}-{max(xs):<6.2f} {100 * med / copy:8.0f}% "
                  + (f"{tok_s:7.1f}" if tok_s else ""))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "load_avg": load, "rows": rows}, f, indent=1)
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    main()
