#!/usr/bin/env python
"""Where the time of one decode step goes: prefill ``--batch`` prompts untimed, then profile ``--steps`` steps in
which every sequence decodes, with torch.profiler; prints the mean step time and the ops by self CPU time,
grouped into attention / linears / MoE / the rest. ``--prefill`` profiles the prompts' prefill instead;
``--python N`` adds a cProfile table of the Python functions with the most own time (per-step work outside ops).

    python scripts/profile_decode_step.py --model .bench/dsv3-65m --dtype float32 --batch 32 --context 128
    python scripts/profile_decode_step.py --model .bench/v4-bench --batch 32 --context 128 --prefill --threads 1

Grouping is by op name (see GROUPS); ops of no group are listed as they are. DeepSeek's decode steps run each
layer's attention and MoE as one op (``layers/decode_blocks.py``: ``mla_decode_block``, ``moe_block``), whose
projections then count in those groups: ``OPENINFER_DECODE_BLOCKS=0`` splits them into their kernels again.
"""
from __future__ import annotations

import argparse
import random
import time

import torch

# op-name substrings -> group (first match wins)
GROUPS = [
    ("attention", ("mla_decode_attention", "mla_decode_block", "paged_decode_attention", "scaled_dot_product", "_flash_attention",
                   "bmm", "baddbmm", "softmax")),
    ("linear", ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "dense_gemv",
                "panel_gemm", "panel_linear", "int8_linear", "int4_linear", "w8a8_linear", "fp8_linear", "mxfp4_linear", "fp8_dequantize")),
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
    ap.add_argument("--quantization", default=None, help="as the engine's --quantization (int8, int4, w8a8, ...)")
    ap.add_argument("--prefill", action="store_true",
                    help="profile the prefill of the --batch prompts (one engine step each) instead of decode steps")
    ap.add_argument("--python", type=int, default=0, metavar="N",
                    help="also print the N Python functions with the most own time over the profiled steps "
                         "(cProfile): the per-step work outside torch ops")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from openinfer import LLM, SamplingParams
    from openinfer.sampling_params import RequestOutputKind

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.context + args.steps * 4 + 8,
              max_num_seqs=max(256, args.batch),
              quantization=args.quantization)
    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.config.model.hf_config["vocab_size"] if hasattr(engine.config.model, "hf_config") else 1000
    # prefill: one token each, so a batch is done when its prefill is (the next batch prefills alone)
    params = SamplingParams(temperature=0.0, max_tokens=1 if args.prefill else args.steps * 4 + 8, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    def add_batch(tag: str) -> None:  # fresh random prompts: no prefix-cache hits between batches
        for i in range(args.batch):
            engine.add_request(f"{tag}{i}", {"prompt_token_ids": [rng.randrange(10, vocab)
                                                                  for _ in range(args.context)]}, params)

    add_batch("p")
    if args.prefill:
        # every step until each request has its first token is prefill work: one batch timed without the profiler
        # (the first: its wall time is what a fresh engine pays), then another batch profiled
        args.steps = 1
        t0, c0 = time.perf_counter(), time.process_time()
        while engine.has_unfinished_requests():
            engine.step()
        plain_ms = (time.perf_counter() - t0) * 1e3
        cpu_ms = (time.process_time() - c0) * 1e3
        add_batch("q")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            while engine.has_unfinished_requests():
                engine.step()
        what = f"prefill of {args.batch} x {args.context} tokens"
    else:
        started = set()
        while len(started) < args.batch:  # every request has its first token: the batch decodes from here
            started.update(o.request_id for o in engine.step() if any(c.token_ids for c in o.outputs))
        for _ in range(args.steps):  # warm-up decode steps (first-touch of buffers, kernel build)
            engine.step()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            engine.step()
        plain_ms = (time.perf_counter() - t0) * 1e3 / args.steps
        cpu_ms = (time.process_time() - c0) * 1e3 / args.steps
        what = f"decode step at batch {args.batch}, context ~{args.context}"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                engine.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    groups: dict[str, float] = {}
    for e in events:
        groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + e.self_cpu_time_total
    # process CPU time next to wall time: on a loaded host the wall time includes waiting for a core
    print(f"{what}: {plain_ms:.1f} ms wall, {cpu_ms:.1f} ms process CPU (unprofiled, mean of {args.steps}); "
          f"profiled self CPU in ops {total / 1e3 / args.steps:.1f} ms/step")
    print("| group | ms/step | share |\n|---|---|---|")
    for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"| {g} | {t / 1e3 / args.steps:.2f} | {100 * t / total:.1f}% |")
    print("\n| op | group | ms/step | share |\n|---|---|---|---|")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]:
        print(f"| {e.key} | {group_of(e.key)} | {e.self_cpu_time_total / 1e3 / args.steps:.2f} | "
              f"{100 * e.self_cpu_time_total / total:.1f}% |")
    if args.python and not args.prefill:
        print_python_profile(engine, args.steps, args.python)


def print_python_profile(engine, steps: int, top: int) -> None:
    """cProfile over ``steps`` engine steps: the ``top`` Python functions by own time, then by cumulative time
    (also scripts/profile_decode_window.py's)."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        engine.step()
    pr.disable()
    print(f"\nPython functions over {steps} steps (cProfile; torch ops count in their caller):")
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)
    pstats.Stats(pr).sort_stats("cumulative").print_stats(top)


if __name__ == "__main__":
    main()
