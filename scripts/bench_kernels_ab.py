#!/usr/bin/env python
"""The C++ CPU kernels timed in-process on fixed DeepSeek-V3 / Llama decode shapes, and an A/B of two checkouts.

One checkout (the current directory's package):

    python scripts/bench_kernels_ab.py --batch 32 --ctx 128 --threads 1

prints one JSON line of per-kernel milliseconds (median of ``--reps`` calls after a warm-up). Two checkouts, e.g.
main against a branch, each with its own kernel build:

    python scripts/bench_kernels_ab.py --ab /work/wt-base /work/wt-branch --rounds 5 --threads 1

runs the single-checkout mode in each checkout in turn (A, B, A, B, ...: a fresh process per run, the cwd being the
checkout so its package is what runs, ``OPENINFER_KERNEL_CACHE`` set to ``<checkout>/.kernel-cache-ab`` unless
``--cache-a`` / ``--cache-b`` say otherwise) and reports, per kernel, the median ms of each side with its min..max
over rounds and the per-round ratio A / B (median, min..max). Interleaving puts the drift of a shared host into the
spread instead of the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _time(fn, reps: int, clock) -> float:
    fn()
    fn()
    ts = []
    for _ in range(reps):
        t = clock()
        fn()
        ts.append(clock() - t)
    return statistics.median(ts) * 1e3


def measure(a: argparse.Namespace) -> dict[str, float]:
    # the current directory's package, not the installed (editable) one: sys.path[0] is this script's folder
    sys.path.insert(0, os.getcwd())
    import torch

    from openinfer.layers import cpu_ops

    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    assert cpu_ops.available(), "the torch backend is selected (OPENINFER_CPU_KERNELS=0)"  # a failed build raises
    # --clock cpu: this thread's CPU time, which a crowded host's time slicing does not inflate; with --threads 1 the
    # kernels run on the calling thread (at::parallel_for runs a single range inline), so it is their whole cost
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    if a.clock == "cpu" and a.threads != 1:
        raise SystemExit("--clock cpu needs --threads 1 (other threads' time would not be counted)")
    B, L, bs = a.batch, a.ctx, 16
    nb = -(-L // bs)
    res: dict[str, float] = {}
    tables = torch.randperm(B * nb).view(B, nb)
    lens = torch.full((B,), L, dtype=torch.long)
    lens[::3] = max(1, L - 5)  # uneven lengths: partial last blocks
    # MLA decode (V3: 8 heads, latent 512 + rope 64), fp32 and bf16 latents
    q = torch.randn(B, 8, 576)
    for name, dt in (("mla_fp32", torch.float32), ("mla_bf16", torch.bfloat16)):
        cache = torch.randn(B * nb, bs, 576).to(dt)
        qq = q.to(dt)
        res[name] = _time(lambda: cpu_ops.mla_decode_attention(qq, cache, tables, lens, 0.05, 512), a.reps, clock)
    # paged decode (Llama-like GQA: 16 q heads, 4 kv heads, head_dim 64 / 128)
    for D in (64, 128):
        for name, dt in ((f"paged_d{D}_fp32", torch.float32), (f"paged_d{D}_bf16", torch.bfloat16)):
            kc = torch.randn(B * nb, bs, 4, D).to(dt)
            vc = torch.randn(B * nb, bs, 4, D).to(dt)
            qq = torch.randn(B, 16, D).to(dt)
            res[name] = _time(lambda: cpu_ops.paged_decode_attention(qq, kc, vc, tables, lens, 0.1), a.reps, clock)
    # MoE pieces at V3-65m shapes: 16 experts top-4, intermediate 256, hidden 512
    T, E, K, inter, H = B, 16, 4, 256, 512
    scores = torch.rand(T, E)
    bias = torch.randn(E) * 0.01
    res["moe_select"] = _time(lambda: cpu_ops.moe_select(scores, bias, K, 8, 4), a.reps, clock)
    for name, dt in (("swiglu_fp32", torch.float32), ("swiglu_bf16", torch.bfloat16)):
        x = torch.randn(T * K, 2 * inter).to(dt)
        res[name] = _time(lambda: cpu_ops.swiglu(x, None), a.reps, clock)
    y = torch.randn(T * K, H)
    inv = torch.randperm(T * K)
    w = torch.rand(T, K)
    out = torch.zeros(T, H)
    res["moe_combine"] = _time(lambda: cpu_ops.moe_combine(out, y, inv, w, True), a.reps, clock)
    xr = torch.randn(T, 32000)
    res["argmax_32000"] = _time(lambda: cpu_ops.argmax_rows(xr), a.reps, clock)
    xn = torch.randn(T, H)
    wn = torch.rand(H)
    res["rms_norm"] = _time(lambda: cpu_ops.rms_norm(xn, wn, 1e-6), a.reps, clock)
    return res


def _one(checkout: str, cache: str, args: list[str]) -> dict[str, float]:
    env = dict(os.environ, OPENINFER_KERNEL_CACHE=cache)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], cwd=checkout, env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def ab(a: argparse.Namespace) -> None:
    args = ["--batch", str(a.batch), "--ctx", str(a.ctx), "--threads", str(a.threads), "--reps", str(a.reps),
            "--clock", a.clock]
    ca = a.cache_a or os.path.join(a.ab[0], ".kernel-cache-ab")
    cb = a.cache_b or os.path.join(a.ab[1], ".kernel-cache-ab")
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for r in range(a.rounds):
        for side, co, cache in (("A", a.ab[0], ca), ("B", a.ab[1], cb)):
            runs[side].append(_one(co, cache, args))
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    print(f"A = {a.ab[0]}\nB = {a.ab[1]}\nbatch {a.batch}, ctx {a.ctx}, threads {a.threads}, {a.rounds} rounds, "
          f"{a.clock} clock")
    print(f"{'kernel':16} {'A ms (min..max)':>24} {'B ms (min..max)':>24} {'A/B median (min..max)':>24}")
    for k in runs["A"][0]:
        va = [r[k] for r in runs["A"]]
        vb = [r[k] for r in runs["B"]]
        ratio = [x / y for x, y in zip(va, vb)]
        print(f"{k:16} {statistics.median(va):8.3f} ({min(va):.3f}..{max(va):.3f})"
              f" {statistics.median(vb):8.3f} ({min(vb):.3f}..{max(vb):.3f})"
              f" {statistics.median(ratio):8.2f}x ({min(ratio):.2f}..{max(ratio):.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: perf_counter; cpu: the calling thread's CPU time (--threads 1 only)")
    ap.add_argument("--ab", nargs=2, metavar=("CHECKOUT_A", "CHECKOUT_B"))
    ap.add_argument("--cache-a")
    ap.add_argument("--cache-b")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if a.ab:
        ab(a)
    else:
        print(json.dumps(measure(a)))


if __name__ == "__main__":
    main()
