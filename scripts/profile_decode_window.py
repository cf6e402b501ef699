#!/usr/bin/env python
"""Where the time of one ``bench throughput --mode decode`` step goes at long context: the same engine, prompts
and shared prefix as the bench (``--shared-prefix-len``: one primed prefix, a distinct tail per request), then
``--steps`` unprofiled and ``--steps`` torch.profiler'd decode steps of the whole batch; prints the mean wall time
and the ops by self CPU time. ``scripts/profile_decode_step.py`` prefills distinct prompts, out of reach at 32k+.

    python scripts/profile_decode_window.py --model /tmp/c41/v41 --context-len 32768 --batch 8 \
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'

Every flag after the script's own is a ``bench throughput`` flag (engine flags included).
``import openinfer`` resolves as Python does: from this script's directory the installed package (/work/main),
so set PYTHONPATH=<checkout> to profile a worktree (the before / after pairs in
docs/results/decode_curve_131k/2026-12-07_indexer_kernel/ were taken that way).
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    from openinfer.bench import throughput as T
    from openinfer.bench.decode_window import _prime_prefix
    from openinfer.bench.workload import resolve_workload

    own = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    own.add_argument("--batch", type=int, default=8)
    own.add_argument("--steps", type=int, default=2)
    own.add_argument("--tail", type=int, default=256, help="distinct tokens per request after the shared prefix")
    own.add_argument("--top", type=int, default=25)
    own.add_argument("--python", type=int, default=0, metavar="N",
                     help="also print the N Python functions with the most own and cumulative time over --steps "
                          "more steps (cProfile): the per-step work outside torch ops, which the op table misses")
    mine, rest = own.parse_known_args()
    bench = argparse.ArgumentParser()
    T.add_args(bench)
    args = bench.parse_args(["--mode", "decode", "--batch-sizes", str(mine.batch), "--decode-steps",
                             str(3 * mine.steps + 2), *rest])
    if not args.shared_prefix_len:
        args.shared_prefix_len = args.context_len - mine.tail
    resolve_workload(args)
    runner = T.OpenInferRunner(args, mine.batch)
    engine = runner.engine
    prompts = T.make_prompts(args.seed, mine.batch, 0, args.input_len, runner.vocab_size, runner.block_size,
                             args.shared_prefix_len)
    from openinfer import SamplingParams
    from openinfer.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=4 * (3 * mine.steps + 4), ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    _prime_prefix(engine, prompts, args.shared_prefix_len)
    for i, p in enumerate(prompts):
        engine.add_request(f"prof{i}", {"prompt_token_ids": p}, params)
    started: set[str] = set()
    while len(started) < mine.batch:
        started.update(o.request_id for o in engine.step() if any(c.token_ids for c in o.outputs))
    engine.step()  # one warm-up decode step
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(mine.steps):
        engine.step()
    wall = (time.perf_counter() - t0) * 1e3 / mine.steps
    cpu = (time.process_time() - c0) * 1e3 / mine.steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(mine.steps):
            engine.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{args.model}: context {args.context_len}, batch {mine.batch}: {wall:.1f} ms/step wall, {cpu:.1f} ms "
          f"process CPU (unprofiled, mean of {mine.steps}); profiled self CPU in ops {total / 1e3 / mine.steps:.1f} "
          f"ms/step")
    print("\n| op | ms/step | share | calls/step |\n|---|---|---|---|")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:mine.top]:
        print(f"| {e.key} | {e.self_cpu_time_total / 1e3 / mine.steps:.2f} | "
              f"{100 * e.self_cpu_time_total / total:.1f}% | {e.count / mine.steps:.0f} |")
    if mine.python:
        from profile_decode_step import print_python_profile  # this script's folder is on sys.path

        print_python_profile(engine, mine.steps, mine.python)
    runner.close()


if __name__ == "__main__":
    main()
