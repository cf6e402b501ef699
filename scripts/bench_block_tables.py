#!/usr/bin/env python
"""A decode step's block tables on the host, before and after the incremental mirrors (``input_batch.BlockIdMirror``):
``AttentionMetadata.build`` over ``--groups`` KV groups of ``context / block_size`` blocks per request, from the
block-id lists (converted id by id, as every step did before) and from the mirrors (one new block appended per
request and step, as in decode). Prints ms per build; both give the same tables (checked).

    python scripts/bench_block_tables.py --batch 8 --context 131072 --groups 3
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from openinfer.forward_context import AttentionMetadata
from openinfer.worker.input_batch import BlockIdMirror


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--groups", type=int, default=3, help="full-width KV groups (V4.1 + DSpark: 3; V4 + MTP: 4 "
                                                           "full-width + 2 coarse)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(2)
    rng = random.Random(0)
    bs, n = args.block_size, args.context // args.block_size
    lists = {f"g{g}": [[rng.randrange(1 << 20) for _ in range(n)] for _ in range(args.batch)]
             for g in range(args.groups)}
    mirrors = {g: [BlockIdMirror(r) for r in rows] for g, rows in lists.items()}
    lens, ctx, tpb, cpu = [1] * args.batch, [args.context] * args.batch, {g: bs for g in lists}, torch.device("cpu")

    def grow() -> None:  # a decode step appends at most one block per request and group
        for rows in lists.values():
            for r in rows:
                r.append(rng.randrange(1 << 20))

    out = {}
    for name, tables in (("lists", lambda: lists), ("mirrors", lambda: {g: [m.tensor() for m in ms]
                                                                        for g, ms in mirrors.items()})):
        AttentionMetadata.build(lens, ctx, tables(), tpb, bs, cpu)  # warm-up (the mirrors' first full conversion)
        spent = 0.0
        for _ in range(args.iters):
            grow()
            t0 = time.perf_counter()
            AttentionMetadata.build(lens, ctx, tables(), tpb, bs, cpu)
            spent += time.perf_counter() - t0
        out[name] = 1e3 * spent / args.iters
    want = AttentionMetadata.build(lens, ctx, lists, tpb, bs, cpu)
    got = AttentionMetadata.build(lens, ctx, {g: [m.tensor() for m in ms] for g, ms in mirrors.items()}, tpb, bs, cpu)
    for g in lists:
        assert torch.equal(want.group(g).block_tables, got.group(g).block_tables)
    print(f"batch {args.batch}, context {args.context}, {args.groups} groups of {n}+ blocks: "
          f"lists {out['lists']:.2f} ms, mirrors {out['mirrors']:.2f} ms per build (mean of {args.iters})")


if __name__ == "__main__":
    main()
