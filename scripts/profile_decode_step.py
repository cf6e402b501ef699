#!/usr/bin/env python
"""Where the time of one decode step goes: prefill ``--batch`` prompts untimed, then profile ``--steps`` steps in
which every sequence decodes, with torch.profiler; prints the mean step time and the ops by self CPU time,
grouped into attention / linears / MoE / the rest.

    python scripts/profile_decode_step.py --model .bench/dsv3-65m --dtype float32 --batch 32 --context 128

Grouping is by op name (see GROUPS); ops of no group are listed as they are.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

# op-name substrings -> group (first match wins)
GROUPS = [
    ("attention", ("mla_decode_attention", "paged_decode_attention", "scaled_dot_product", "_flash_attention",
                   "bmm", "baddbmm", "softmax")),
    ("linear", ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "dense_gemv",
                "int8_linear", "int4_linear")),
    ("moe", ("argsort", "bincount", "index_add", "_grouped_mm", "sort", "topk", "moe_")),
]


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from openinfer import LLM, SamplingParams
    from openinfer.sampling_params import RequestOutputKind

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.context + 512, max_num_seqs=max(256, args.batch))
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.config.model.hf_config["vocab_size"] if hasattr(engine.config.model, "hf_config") else 1000
    params = SamplingParams(temperature=0.0, max_tokens=args.steps * 3 + 8, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    for i in range(args.batch):
        engine.add_request(f"p{i}", {"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(args.context)]},
                           params)
    started: set[str] = set()
    while len(started) < args.batch:  # every request has its first token: the batch decodes from here
        started.update(o.request_id for o in engine.step() if any(c.token_ids for c in o.outputs))
    for _ in range(args.steps):  # warm-up decode steps (first-touch of buffers, kernel build)
        engine.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    plain_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    groups: dict[str, float] = {}
    for e in events:
        groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + e.self_cpu_time_total
    print(f"decode step at batch {args.batch}, context ~{args.context}: {plain_ms:.1f} ms (unprofiled mean of "
          f"{args.steps}); profiled self CPU {total / 1e3 / args.steps:.1f} ms/step")
    print("| group | ms/step | share |\n|---|---|---|")
    for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"| {g} | {t / 1e3 / args.steps:.2f} | {100 * t / total:.1f}% |")
    print("\n| op | group | ms/step | share |\n|---|---|---|---|")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]:
        print(f"| {e.key} | {group_of(e.key)} | {e.self_cpu_time_total / 1e3 / args.steps:.2f} | "
              f"{100 * e.self_cpu_time_total / total:.1f}% |")


if __name__ == "__main__":
    main()
