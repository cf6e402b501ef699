"""Microbenchmark (not a test): one layer's decode attention on CPU, the C++ paged kernel vs gather + SDPA.

Shapes default to the 246M Llama bench model (16 q heads, 4 kv heads, head_dim 64, block_size 16); each
sequence gets ~``--ctx`` tokens (+-25%) in shuffled blocks.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_cpu_decode_attention.py --batch 1,8,32,64

``--kv-cache-dtype auto,fp8`` times the kernel over the same K/V stored in the model dtype and in float8_e4m3fn
(kv_cache_dtype fp8), interleaved round by round in one process, and prints each one's median with its min..max
spread and the median of the per-round ratios (absolute times on a shared machine drift; ratios measured side by
side hold).
"""
from __future__ import annotations

import argparse
import functools
import time

import torch

from openinfer.forward_context import AttentionMetadata
from openinfer.layers import cpu_ops
from openinfer.layers.attention import Attention
from openinfer.layers.kv_quant import FP8_DTYPE, to_cache


def make_decode_batch(batch: int, ctx: int, bs: int, hk: int, d: int, dtype: torch.dtype,
                      gen: torch.Generator):
    lens = [max(1, int(ctx * (0.75 + 0.5 * torch.rand(1, generator=gen).item()))) for _ in range(batch)]
    nbs = [-(-n // bs) for n in lens]
    num_blocks = sum(nbs) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, off = [], 0
    for nb in nbs:
        tables.append(perm[off:off + nb])
        off += nb
    md = AttentionMetadata.build([1] * batch, lens, {"full": tables}, {"full": bs}, bs, torch.device("cpu"))
    kc = torch.randn(num_blocks, bs, hk, d, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, bs, hk, d, generator=gen).to(dtype)
    return md, kc, vc


def bench(fn, min_time: float = 0.3) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        el = time.perf_counter() - t0
        if el > min_time and n >= 5:
            return el / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--hq", type=int, default=16)
    ap.add_argument("--hk", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default=None,
                    help="comma list, e.g. auto,fp8: compare the kernel over caches of these dtypes instead")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if args.kv_cache_dtype:
        return compare_cache_dtypes(args)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if cpu_ops.get_ops() is None:
        raise SystemExit("the C++ kernel is unavailable (see the warning above)")
    print(f"{args.dtype}, {args.threads} threads, Hq={args.hq} Hk={args.hk} D={args.head_dim} "
          f"block_size={args.block_size}, ctx ~{args.ctx}")
    print(f"{'B':>4} {'gather+SDPA ms':>15} {'kernel ms':>10} {'speedup':>8}")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for b in [int(x) for x in args.batch.split(",")]:
            md, kc, vc = make_decode_batch(b, args.ctx, args.block_size, args.hk, args.head_dim, dtype, gen)
            attn = Attention(args.hq, args.hk, args.head_dim, args.head_dim ** -0.5)
            attn.k_cache, attn.v_cache = kc, vc
            q = torch.randn(b, args.hq, args.head_dim, generator=gen).to(dtype)
            out = torch.empty_like(q)

            # the additive mask is built once per step (cached on md), shared by the layers, as in the model
            tables = md.group("full")
            sdpa_layer = functools.partial(lambda a, q, md, out: out.copy_(a._decode_gather_sdpa(q, md, tables)),
                                           attn, q, md, out)
            kernel = functools.partial(cpu_ops.paged_decode_attention, q, kc, vc, tables.decode_block_tables,
                                       md.decode_seq_lens, attn.scale, out=out)
            t_s, t_k = bench(sdpa_layer), bench(kernel)
            print(f"{b:>4} {t_s * 1e3:>15.3f} {t_k * 1e3:>10.3f} {t_s / t_k:>7.1f}x", flush=True)


def compare_cache_dtypes(args) -> None:
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kinds = args.kv_cache_dtype.split(",")
    if cpu_ops.get_ops() is None:
        raise SystemExit("the C++ kernel is unavailable (see the warning above)")
    print(f"paged decode kernel, q {args.dtype}, {args.threads} threads, Hq={args.hq} Hk={args.hk} D={args.head_dim} "
          f"block_size={args.block_size}, ctx ~{args.ctx}, {args.rounds} interleaved rounds; ms median (min..max)")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for b in [int(x) for x in args.batch.split(",")]:
            md, kc, vc = make_decode_batch(b, args.ctx, args.block_size, args.hk, args.head_dim, dtype, gen)
            caches = {k: (kc, vc) if k == "auto" else (to_cache(kc, FP8_DTYPE), to_cache(vc, FP8_DTYPE))
                      for k in kinds}
            q = torch.randn(b, args.hq, args.head_dim, generator=gen).to(dtype)
            out = torch.empty_like(q)
            tables = md.group("full")
            fns = {k: functools.partial(cpu_ops.paged_decode_attention, q, k_, v_, tables.decode_block_tables,
                                        md.decode_seq_lens, args.head_dim ** -0.5, out=out)
                   for k, (k_, v_) in caches.items()}
            times = {k: [] for k in kinds}
            for _ in range(args.rounds):
                for k in kinds:
                    times[k].append(bench(fns[k], min_time=0.1))
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            parts = [f"{k} ({caches[k][0].element_size()} B/elem) {med[k] * 1e3:.3f} "
                     f"({min(times[k]) * 1e3:.3f}..{max(times[k]) * 1e3:.3f})" for k in kinds]
            ratios = sorted(times[kinds[0]][i] / times[kinds[-1]][i] for i in range(args.rounds))
            print(f"B={b:>4}: " + ", ".join(parts) + f"; {kinds[0]}/{kinds[-1]} per round median "
                  f"{ratios[len(ratios) // 2]:.2f}x ({ratios[0]:.2f}..{ratios[-1]:.2f})", flush=True)


if __name__ == "__main__":
    main()
