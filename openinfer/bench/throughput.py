"""``openinfer bench throughput``: offline throughput over a batch-size sweep, optionally against HF.

Two modes (flags and their rules: ``workload.py``). In the default e2e mode each point submits ``batch``
requests with fixed input/output lengths through ``LLM.generate`` and times the whole call, so output tok/s
includes prefill, like vLLM's ``bench throughput`` and the figures in cpu_peers.md. Prompts are seeded
random token ids, distinct per request and per iteration, and the prefix cache is reset before every
iteration: a benchmark that hits the prefix cache measures the cache, not the engine. On this class of VM
the first pass over fresh memory is 5-20x slow, so every engine first runs one full untimed iteration at its
largest batch, then ``--warmup-iters`` untimed ones per point. ``--mode decode`` times steady-state decode
instead: ``decode_window.py`` (openinfer) and ``HFRunner.run_decode``.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from openinfer.bench import results as R
from openinfer.bench.workload import (DECODE_TAIL_TOKENS, add_workload_args, check_fits, resolve_workload, tokens_needed,
                                     tokens_per_step)
from openinfer import vllm_compat
from openinfer.engine_args import EngineArgs

logger = logging.getLogger(__name__)

ENGINES = ("openinfer", "hf")
# Flags the --fresh-process parent sets itself on each child instead of copying from its own command line.
_PER_CHILD = {"batch_sizes", "output_json", "fresh_process", "only_engine", "engine_args_json", "help"}
# Engine settings reach a child as one EngineArgs JSON (--engine-args-json), not as flags.
_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineArgs))


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    g = p.add_argument_group("throughput")
    g.add_argument("--vs", choices=["hf"], default=None, help="also run HF transformers generate per point")
    g.add_argument("--output-json", default=None, help="write results here")
    g.add_argument("--fresh-process", action="store_true",
                   help="run each (engine, batch) point in its own subprocess and merge the JSON")
    g.add_argument("--only-engine", choices=ENGINES, default=None, help=argparse.SUPPRESS)
    # A child's engine settings: the parent's EngineArgs as JSON, replacing this command line's engine flags.
    g.add_argument("--engine-args-json", default=None, help=argparse.SUPPRESS)


def make_prompts(seed: int, batch: int, iteration: int, input_len: int, vocab_size: int,
                 block_size: int = 16, shared_prefix_len: int = 0) -> list[list[int]]:
    """Seeded random prompts; the first KV block of every prompt differs, so no request can hit another's
    cached prefix. The same (seed, batch, iteration) gives the same prompts to every engine. With
    ``shared_prefix_len`` P, every prompt starts with the same P seeded tokens (the same for every batch and
    iteration of a seed, so one prefill of it serves a whole sweep) and the rule holds for the first block of
    the distinct tails after them."""
    prefix_rng = random.Random(seed * 7919 + 17)
    prefix = [prefix_rng.randrange(vocab_size) for _ in range(shared_prefix_len)]
    rng = random.Random(seed * 1_000_003 + batch * 1009 + iteration)
    input_len -= shared_prefix_len
    head = min(block_size, input_len)
    if vocab_size ** head < 2 * batch:
        raise ValueError(f"vocab {vocab_size} is too small for {batch} distinct {head}-token prompt heads")
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    while len(prompts) < batch:
        ids = [rng.randrange(vocab_size) for _ in range(input_len)]
        if tuple(ids[:head]) not in seen:
            seen.add(tuple(ids[:head]))
            prompts.append(prefix + ids)
    return prompts


class OpenInferRunner:
    name = "openinfer"

    def __init__(self, args: argparse.Namespace, max_batch: int) -> None:
        from openinfer import LLM

        t0 = time.perf_counter()
        self.llm = LLM(**bench_engine_args(args, max_batch).to_dict())
        self.init_time_s = time.perf_counter() - t0
        self.engine = self.llm.engine
        check_fits(args, self.engine.config.model.max_model_len, "max_model_len")
        self.temperature = args.temperature
        self.shared_prefix_len = getattr(args, "shared_prefix_len", 0)
        if self.shared_prefix_len and not self.engine.config.cache.enable_prefix_caching:
            raise ValueError("--shared-prefix-len needs the prefix cache: drop --no-enable-prefix-caching")
        self.last_window = None  # decode mode: the latest DecodeWindow (tokens, for parity checks)

    @property
    def vocab_size(self) -> int:
        return self.engine.config.model.vocab_size

    @property
    def block_size(self) -> int:
        return self.engine.config.cache.block_size

    def describe(self) -> dict[str, Any]:
        cfg = self.engine.config
        return {
            "runner": "openinfer LLM.generate",
            "dtype": str(cfg.model.dtype).removeprefix("torch."),
            "quantization": cfg.model.quantization,
            "device": str(cfg.model.device),
            "max_num_seqs": cfg.scheduler.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
            "max_model_len": cfg.model.max_model_len,
            "block_size": cfg.cache.block_size,
            "enable_prefix_caching": cfg.cache.enable_prefix_caching,
            "num_kv_blocks": self.engine.stats().num_blocks,
            "attention_backend": cfg.attention_backend.value,
            "parallel": dataclasses.asdict(cfg.parallel),
            "sampling": f"temperature {self.temperature}" if self.temperature else "greedy (temperature 0)",
            "startup_message": self.engine.startup_message,
            "init_time_s": self.init_time_s,
            "load_time_s": self.engine.load_time_s,
        }

    def run(self, prompts: list[list[int]], output_len: int) -> R.IterationSample:
        from openinfer import SamplingParams

        params = SamplingParams(temperature=self.temperature, max_tokens=output_len, min_tokens=output_len,
                                ignore_eos=True)
        self.engine.reset_prefix_cache()
        preempt0 = self.engine.stats().num_preemptions
        spec0 = self.engine.stats().spec_decode
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        if n_out != len(prompts) * output_len:
            raise RuntimeError(f"openinfer generated {n_out} tokens, expected {len(prompts) * output_len}")
        ttfts = [o.metrics.time_to_first_token for o in outs if o.metrics is not None]
        ttfts = [t for t in ttfts if t is not None]
        return R.IterationSample(
            elapsed_s=elapsed, num_output_tokens=n_out, num_input_tokens=sum(len(p) for p in prompts),
            mean_ttft_s=sum(ttfts) / len(ttfts) if ttfts else None,
            cached_prompt_tokens=sum(o.num_cached_tokens for o in outs),
            num_preemptions=self.engine.stats().num_preemptions - preempt0,
            spec_drafts=_spec_delta(spec0, self.engine.stats().spec_decode),
        )

    def run_decode(self, prompts: list[list[int]], decode_steps: int) -> R.IterationSample:
        from openinfer.bench.decode_window import run_decode_window

        self.last_window = run_decode_window(self.engine, prompts, decode_steps, self.temperature,
                                             shared_prefix_len=self.shared_prefix_len)
        return self.last_window.sample

    def close(self) -> None:
        self.engine.shutdown()  # worker processes, when there are any
        del self.engine, self.llm


def _spec_delta(before, after) -> tuple[int, int, int]:
    return (after.num_drafts - before.num_drafts, after.num_draft_tokens - before.num_draft_tokens,
            after.num_accepted_tokens - before.num_accepted_tokens)


def bench_engine_args(args: argparse.Namespace, max_batch: int) -> EngineArgs:
    """The engine a sweep whose largest batch is ``max_batch`` builds, from the engine flags: unless set,
    ``max_num_seqs`` follows that batch and ``max_model_len`` is sized for the workload, so the KV cache and
    the start-up profile pass touch only the memory the sweep uses (fresh memory is what the VM is slow on)."""
    vllm_compat.log_noops(args)  # one line per vLLM flag accepted as a no-op
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.max_num_seqs is None:
        engine_args = dataclasses.replace(engine_args, max_num_seqs=max_batch)
    if engine_args.max_model_len is None:
        engine_args = dataclasses.replace(
            engine_args, max_model_len=tokens_needed(args) + _decode_headroom(args, max_batch))
    return engine_args


def adopt_parent_engine_args(args: argparse.Namespace) -> None:
    """A child of ``--fresh-process`` or ``bench peers``: the parent's ``EngineArgs`` (``--engine-args-json``)
    replace this command line's engine flags, so the child builds the very engine the parent described."""
    for name, value in EngineArgs.from_json(args.engine_args_json).to_dict().items():
        setattr(args, name, value)


def _decode_headroom(args: argparse.Namespace, max_batch: int) -> int:
    """Decode mode: requests admitted in the first prefill steps decode one token per later prefill step,
    so the default max_model_len leaves one token per prefill step (counted at the smallest default step
    budget, 2048 tokens) on top of context + window."""
    if args.mode != "decode":
        return 0
    budget = args.max_num_batched_tokens or 2048
    # Only the distinct tails are prefilled alongside decodes when a prefix is shared; a speculative step
    # can add 1 + k tokens.
    prefill = max_batch * (args.context_len - getattr(args, "shared_prefix_len", 0))
    return -(-prefill // budget) * tokens_per_step(args)


def sweep(runner, batches: list[int], args: argparse.Namespace, vocab_size: int, block_size: int,
          num_devices: int = 1) -> list[dict[str, Any]]:
    def prompts(b: int, it: int) -> list[list[int]]:
        return make_prompts(args.seed, b, it, args.input_len, vocab_size, block_size,
                            getattr(args, "shared_prefix_len", 0))

    decode = args.mode == "decode"

    def measure(p: list[list[int]]) -> R.IterationSample:
        return runner.run_decode(p, args.decode_steps) if decode else runner.run(p, args.output_len)

    # Iteration indices: -1 = sweep warm-up, -2.. = per-point warm-ups, 0.. = timed; all distinct prompt sets.
    t0 = time.perf_counter()
    measure(prompts(batches[-1], -1))
    logger.info("%s: warm-up at batch %d took %.1f s", runner.name, batches[-1], time.perf_counter() - t0)
    summaries = []
    last = batches[-1]
    # Points from the largest down: the sweep warm-up then is the largest point's warm-up as well (one full
    # iteration at the costliest batch saved; in decode mode at batch 256 that is 256 tails prefilled once more).
    for b in reversed(batches):
        # A warm-up at this very batch just before (the sweep warm-up for the largest point) counts as one: at
        # batch 256 an iteration can take many minutes.
        for w in range(args.warmup_iters - (last == b)):
            measure(prompts(b, -2 - w))
        out_len = args.decode_steps if decode else args.output_len
        point = R.PointResult(runner.name, b, args.input_len, out_len, num_devices, mode=args.mode,
                              context_len=args.context_len,
                              decode_steps=args.decode_steps if decode else None)
        for it in range(args.num_iters):
            point.samples.append(measure(prompts(b, it)))
        s = point.summary()
        print(f"[{runner.name}] batch {b}: {s['output_throughput']:.1f} output tok/s "
              f"(min {s['output_throughput_min']:.1f}, max {s['output_throughput_max']:.1f}), "
              f"{s['total_token_throughput']:.1f} total tok/s, {s['requests_per_second']:.3f} req/s"
              + (f", {100 * s['spec_acceptance_rate']:.1f}% of drafts accepted, "
                 f"{s['spec_mean_accepted_length']:.2f} tokens per verification" if "spec_num_drafts" in s else ""),
              flush=True)
        summaries.append(s)
        last = b
    return summaries[::-1]  # ascending batch, as the batches came


def workload_block(args: argparse.Namespace, batches: list[int], with_hf: bool) -> dict[str, Any]:
    decode = args.mode == "decode"
    return {
        "mode": args.mode, "context_len": args.context_len, "decode_steps": args.decode_steps,
        "input_len": args.input_len, "output_len": args.output_len, "batch_sizes": batches,
        "num_iters": args.num_iters, "warmup_iters": args.warmup_iters, "seed": args.seed,
        "temperature": args.temperature, "ignore_eos": True,
        "min_tokens": None if decode else args.output_len,
        "num_devices": args.num_devices, "speculative_config": args.speculative_config_value,
        "hf_max_batch": args.hf_max_batch if with_hf else None,
        "shared_prefix_len": args.shared_prefix_len,
        "prompts": ("seeded random token ids, distinct first KV block per request and distinct per iteration; "
                    "prefix cache reset before each iteration, so no prefix-cache hits "
                    "(see cached_prompt_tokens)") if not args.shared_prefix_len else (
                   f"seeded random token ids: the first {args.shared_prefix_len} are one prefix shared by "
                   f"every request of the sweep, prefilled by a priming request (untimed) and kept in the prefix "
                   f"cache (not reset between iterations); each request hits it and prefills only its distinct "
                   f"tail (distinct first block, distinct per iteration); cached_prompt_tokens counts the hits"),
        "timing": DECODE_TIMING if decode else E2E_TIMING,
        "warmup": "one untimed iteration at each engine's largest batch, then the points from the largest "
                  "batch down with warmup_iters per point (the first of which is skipped when the previous "
                  "iteration ran at the same batch: the largest point's is the sweep warm-up)",
    }


E2E_TIMING = ("wall time of one LLM.generate / HF generate call over the whole batch, prefill included; "
              "median over iterations, min/max = spread; TTFT = submission to first token, mean over "
              "requests (HF: the whole batch's first token)")
DECODE_TIMING = ("untimed prefill of the whole batch to context_len, then wall time of exactly decode_steps "
                 "steps in which every sequence decodes one token (openinfer: LLMEngine.step; HF: a manual "
                 "greedy loop of model forwards with past_key_values); output tok/s = batch * decode_steps / "
                 f"time; max_model_len leaves {DECODE_TAIL_TOKENS} tokens past the window so no request "
                 "stops inside it; kv_context_min/max = KV tokens a request held at the window's start")


def _workload(args: argparse.Namespace, batches: list[int]) -> dict[str, Any]:
    return dict(workload_block(args, batches, bool(args.vs)), vs=args.vs,
                fresh_process=bool(args.fresh_process))


def main(args: argparse.Namespace) -> int:
    import torch

    if args.engine_args_json is not None:
        adopt_parent_engine_args(args)
    batches = resolve_workload(args)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.fresh_process and args.only_engine is None:
        result = _run_fresh(args, batches)
    else:
        result = _run_here(args, batches)
    R.print_table(result)
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.output_json}")
    return 0


def _run_here(args: argparse.Namespace, batches: list[int]) -> dict[str, Any]:
    from openinfer.config import resolve_dtype
    from openinfer.platform import resolve_device

    engines = [e for e in ("openinfer", "hf" if args.vs else None) if e and args.only_engine in (None, e)]
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, {}, device)  # "auto" resolves as the engine does, for HF too
    device = str(device)
    result = R.new_result(sys.argv, R.environment(device, args.num_devices), _workload(args, batches))
    num_devices = result["environment"]["num_devices"]
    warning = R.dtype_warning(result["environment"], str(dtype).removeprefix("torch."))
    if warning:
        result["notes"].append(warning)
        logger.warning(warning)
    vocab = block = None
    if "openinfer" in engines:
        runner = OpenInferRunner(args, batches[-1])
        print(runner.engine.startup_message, flush=True)
        vocab, block = runner.vocab_size, runner.block_size
        result["engines"]["openinfer"] = runner.describe()
        result["environment"]["model"] = R.model_info(runner.engine.config.model.path)
        for s in sweep(runner, batches, args, vocab, block, num_devices):
            R.add_point(result, s)
        if runner.engine.config.parallel.enable_eplb:
            result["engines"]["openinfer"]["expert_load"] = msgspec.structs.asdict(runner.engine.core.expert_load)
        runner.close()
        del runner
        gc.collect()  # free our weights and KV cache before HF allocates its own
    if "hf" in engines:
        from openinfer.assets_path import default_model_path
        from openinfer.bench.hf_peer import HFRunner

        path = args.model or default_model_path()
        info = R.model_info(path)
        result["environment"].setdefault("model", info)
        hf_batches = [b for b in batches if b <= args.hf_max_batch]
        if hf_batches:
            hf = HFRunner(path, dtype, device, experts_implementation=args.hf_experts_implementation)
            result["engines"]["hf"] = hf.describe()
            for s in sweep(hf, hf_batches, args, vocab or info["vocab_size"], block or args.block_size,
                           num_devices):
                R.add_point(result, s)
            hf.close()
        skipped = [b for b in batches if b > args.hf_max_batch]
        if skipped:
            result["notes"].append(f"HF not run at batch {skipped} (> --hf-max-batch {args.hf_max_batch})")
    # Load at the end too: other processes starting mid-run show up here, not in the start figure.
    result["environment"]["load_average_end"] = R.load_average()
    if args.vs and args.temperature != 0:
        result["notes"].append(f"openinfer sampled at temperature {args.temperature}; HF ran greedy")
    return result


def child_argv(args: argparse.Namespace, batch: int, max_batch: int, engine: str, json_path: str,
               skip: frozenset[str] = frozenset(), extra: tuple[str, ...] = ()) -> list[str]:
    """The same command for one (engine, batch), rebuilt from the parsed flags so it works however the
    parent was started (console script, ``python -m``, or ``main()`` called directly). The engine settings go
    as one ``--engine-args-json``: the engine the single-process run would build (``bench_engine_args`` at
    the sweep's largest batch). ``skip`` names the parent's own flags a throughput child does not take;
    ``extra`` is appended."""
    argv = [sys.executable, "-m", "openinfer", "bench", "throughput"]
    for action in args._bench_parser._actions:
        if (not action.option_strings or action.dest in _PER_CHILD or action.dest in _ENGINE_FIELDS
                or action.dest in skip):
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        if action.nargs == 0:  # store_true / store_false flags
            argv.append(action.option_strings[0])
        else:
            argv += [action.option_strings[0], str(value)]
    argv += ["--engine-args-json", bench_engine_args(args, max_batch).to_json()]
    return argv + ["--batch-sizes", str(batch), "--only-engine", engine, "--output-json", json_path, *extra]


def _run_fresh(args: argparse.Namespace, batches: list[int]) -> dict[str, Any]:
    """One subprocess per (engine, batch): cpu_peers.md saw one process drift 3x across configs."""
    result: dict[str, Any] | None = None
    # Interleaved by batch, so load from other processes drifting over a long sweep hits both engines'
    # figures for a point alike instead of skewing their ratio.
    plan = [(b, e) for b in batches for e in ENGINES
            if e == "openinfer" or (args.vs and b <= args.hf_max_batch)]
    with tempfile.TemporaryDirectory(prefix="openinfer-bench-") as tmp:
        for i, (b, engine) in enumerate(plan):
            path = str(Path(tmp) / f"{i}.json")
            cmd = child_argv(args, b, batches[-1], engine, path)
            print(f"--- fresh process {i + 1}/{len(plan)}: {engine} batch {b}", flush=True)
            rc = subprocess.run(cmd).returncode
            if rc != 0:
                raise RuntimeError(f"child failed with exit code {rc}: {' '.join(cmd)}")
            child = json.loads(Path(path).read_text())
            if result is None:
                result = R.new_result(sys.argv, child["environment"], _workload(args, batches))
            desc = child["engines"][engine]
            result["engines"].setdefault(engine, dict(desc, per_process=[]))["per_process"].append(
                {"batch_size": b, "init_time_s": desc.get("init_time_s"),
                 "load_time_s": desc.get("load_time_s")})
            result["environment"].setdefault("model", child["environment"].get("model"))
            for note in child["notes"]:
                if note not in result["notes"] and "hf-max-batch" not in note:
                    result["notes"].append(note)
            result["environment"].setdefault("per_process_load_average", []).append(
                {"engine": engine, "batch_size": b, "load_average": child["environment"]["load_average"],
                 "load_average_end": child["environment"].get("load_average_end")})
            for p in child["points"]:
                if p.get(engine):
                    R.add_point(result, p[engine])
    assert result is not None
    skipped = [b for b in batches if args.vs and b > args.hf_max_batch]
    if skipped:
        result["notes"].append(f"HF not run at batch {skipped} (> --hf-max-batch {args.hf_max_batch})")
    return result
