"""Micro-benchmark of V4.1's indexer kernel (cpu_ops.indexer_select, cpu_kernels/indexer_select.cpp) on the tiny
``curve`` model's shapes: 4 index heads x 32 dims, bf16 index keys paged in blocks, top-512, candidate blocks of 8
entries (256 kept). A decode step: ``--batch`` sequences of ``--context`` tokens, each with ``--queries`` (1 + 3
verified) consecutive queries; ``--prefill N``: one sequence's last N positions instead (a prefill chunk).
Layers: ``plain`` (an index layer), ``source`` (also emits the candidate blocks), ``restricted`` (scores only the
candidate blocks' entries). Prints ms per call and ns per (query, scored entry).

  python scripts/bench_indexer_select.py --context 4096 --batch 32 --ratio 1 --layer source
Uses whatever ``openinfer`` imports (PYTHONPATH picks the checkout)."""
from __future__ import annotations

import argparse
import time

import torch

from openinfer.layers import cpu_ops

BS = 64  # tokens per paged block


def problem(context: int, batch: int, queries: int, prefill: int, ratio: int, gen: torch.Generator):
    cap = BS // ratio
    need = -(-context // BS)
    seqs = 1 if prefill else batch
    perm = torch.randperm(seqs * need, generator=gen)
    tables = perm.view(seqs, need).contiguous()
    keys = torch.randn(seqs * need * cap, 32, generator=gen).to(torch.bfloat16)
    if prefill:
        positions = torch.arange(context - prefill, context)
        token_seq = torch.zeros(prefill, dtype=torch.long)
    else:
        positions = torch.arange(context - queries, context).repeat(batch)
        token_seq = torch.arange(batch).repeat_interleave(queries)
    t = token_seq.numel()
    q = torch.randn(t, 4, 32, generator=gen).to(torch.bfloat16)
    head_w = torch.randn(t, 4, generator=gen) * 0.5
    return q, head_w, keys, tables, token_seq, (positions + 1) // ratio, cap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--prefill", type=int, default=0, help="one sequence's last N positions instead of a batch")
    ap.add_argument("--ratio", type=int, default=1, choices=(1, 2))
    ap.add_argument("--layer", default="plain", choices=("plain", "source", "restricted"))
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if cpu_ops.get_ops() is None:
        raise SystemExit("the CPU kernels are not available")
    gen = torch.Generator().manual_seed(0)
    q, head_w, keys, tables, token_seq, visible, cap = problem(args.context, args.batch, args.queries, args.prefill,
                                                               args.ratio, gen)
    k, cblock, nblocks = 512, 8, 256
    call = dict(q=q, head_w=head_w, keys=keys, tables=tables, token_seq=token_seq, visible=visible, k=k,
                scale=32 ** -0.5, ratio=args.ratio, block_size=BS, cap=cap)
    scored = int(visible.sum())
    if args.layer == "source":
        call.update(candidate_block=cblock, num_blocks=nblocks)
    elif args.layer == "restricted":
        _, blocks = cpu_ops.indexer_select(**call, candidate_block=cblock, num_blocks=nblocks)
        call.update(candidate_block=cblock, allowed=blocks)
        scored = int(torch.minimum(visible, torch.full_like(visible, nblocks * cblock)).sum())
    cpu_ops.indexer_select(**call)  # warm-up
    t0 = time.perf_counter()
    for _ in range(args.iters):
        cpu_ops.indexer_select(**call)
    dt = (time.perf_counter() - t0) / args.iters
    shape = f"prefill {args.prefill}" if args.prefill else f"batch {args.batch} x {args.queries} queries"
    print(f"context {args.context} {shape} ratio {args.ratio} {args.layer}: {dt * 1e3:.2f} ms per call, "
          f"{dt * 1e9 / scored:.2f} ns per (query, entry), {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
