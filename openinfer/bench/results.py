"""The result schema shared by the offline benchmarks: environment capture, per-point statistics, the table.

Field names follow vLLM (`bench throughput` / `bench serve`: ``requests_per_second``, ``output_throughput``,
``total_token_throughput``, ``elapsed_time``) so results drop into dashboards that already read them. Every
throughput also has a ``*_per_device`` twin (divided by ``num_devices``) so the multi-device view of issue 5
reads the same files without a schema change.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openinfer.platform import FAST_BF16_CPU_FLAGS
from openinfer.platform import cpu_info as config_cpu_info

SCHEMA = "openinfer.bench.throughput/v1"

# CPU features that decide which kernels torch can use; peers' numbers are only comparable on matching flags
# (cpu_peers.md was measured on an AMX machine, bf16 is emulated and slow on AVX2-only hosts).
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni",
              "amx_bf16", "amx_int8", "amx_tile")


def cpu_info() -> dict[str, Any]:
    model, flags = config_cpu_info()
    return {"cpu_model": model if model != "unknown" else (platform.processor() or model),
            "cpu_count": os.cpu_count(), "cpu_flags": [f for f in _CPU_FLAGS if f in flags]}


def dtype_warning(env: dict[str, Any], dtype: str) -> str | None:
    """bf16 GEMMs without native bf16 support (avx512_bf16 or AMX) fall back to slow conversion kernels in
    torch's CPU build: on an AVX2-only host a bf16 linear measured 3-7x slower than fp32 at M >= 32. Such a
    run says little about the engine, and must not be compared with cpu_peers.md (an AMX host)."""
    if env.get("device") != "cpu" or dtype not in ("bfloat16", "bf16"):
        return None
    if FAST_BF16_CPU_FLAGS & set(env.get("cpu_flags", [])):
        return None
    return (f"bf16 on a CPU without avx512_bf16/amx_bf16 ({env.get('cpu_model')}): torch falls back to slow "
            f"bf16 kernels; compare dtypes with --dtype float32 and do not compare with AMX-host numbers")


def environment(device: str, num_devices: int = 1) -> dict[str, Any]:
    import torch
    import transformers

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "openinfer": _openinfer_version(),
        "platform": platform.platform(),
        "device": device,
        "num_devices": num_devices,
        "torch_num_threads": torch.get_num_threads(),
        "env_vars": threading_env(),
        "load_average": load_average(),
        **cpu_info(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(0)
    return env


def threading_env() -> dict[str, str]:
    """Variables that change CPU kernels or threading. OMP_WAIT_POLICY matters most on a shared host: with
    2 threads and other processes running, tiny ops measured 100x slower with the default active wait."""
    prefixes = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "ONEDNN_", "DNNL_", "ATEN_")
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes) or k == "LD_PRELOAD"}


def _openinfer_version() -> str:
    import openinfer

    return openinfer.__version__


def load_average() -> list[float] | None:
    # Other processes on the host skew every number; recording the load lets a reader discard noisy runs.
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


@dataclass
class IterationSample:
    """One timed pass of ``batch`` requests through an engine."""

    elapsed_s: float
    num_output_tokens: int
    num_input_tokens: int
    mean_ttft_s: float | None = None
    cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    # Decode mode: the fewest and most KV tokens a request held when the timed window started.
    kv_context: tuple[int, int] | None = None
    # Speculative decoding in this pass: verifications, drafted tokens, accepted tokens (all 0 without it).
    spec_drafts: tuple[int, int, int] = (0, 0, 0)


@dataclass
class PointResult:
    """All iterations of one engine at one batch size, reduced to medians and spreads."""

    engine: str
    batch_size: int
    input_len: int
    output_len: int
    num_devices: int
    samples: list[IterationSample] = field(default_factory=list)
    mode: str = "e2e"  # or "decode": output_len is then the timed decode steps, input tokens are 0
    context_len: int | None = None
    decode_steps: int | None = None

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            raise ValueError(f"{self.engine} batch {self.batch_size}: no timed iterations")
        elapsed = [s.elapsed_s for s in self.samples]
        out_tps = [s.num_output_tokens / s.elapsed_s for s in self.samples]
        tot_tps = [(s.num_output_tokens + s.num_input_tokens) / s.elapsed_s for s in self.samples]
        req_ps = [self.batch_size / s.elapsed_s for s in self.samples]
        ttfts = [s.mean_ttft_s for s in self.samples if s.mean_ttft_s is not None]
        first = self.samples[0]
        out_med = statistics.median(out_tps)
        d = {
            "engine": self.engine,
            "batch_size": self.batch_size,
            "num_requests": self.batch_size,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "num_iters": len(self.samples),
            "total_input_tokens": first.num_input_tokens,
            "total_output_tokens": first.num_output_tokens,
            "total_num_tokens": first.num_input_tokens + first.num_output_tokens,
            "elapsed_time": statistics.median(elapsed),
            "elapsed_times": elapsed,
            # Medians of the per-iteration rates, so median/min/max below describe the same distribution.
            "output_throughput": out_med,
            "output_throughput_min": min(out_tps),
            "output_throughput_max": max(out_tps),
            "output_throughput_spread_pct": 100.0 * (max(out_tps) - min(out_tps)) / out_med,
            "total_token_throughput": statistics.median(tot_tps),
            "total_token_throughput_min": min(tot_tps),
            "total_token_throughput_max": max(tot_tps),
            "requests_per_second": statistics.median(req_ps),
            "requests_per_second_min": min(req_ps),
            "requests_per_second_max": max(req_ps),
            "mean_ttft_ms": 1000.0 * statistics.median(ttfts) if ttfts else None,
            "cached_prompt_tokens": sum(s.cached_prompt_tokens for s in self.samples),
            "num_preemptions": sum(s.num_preemptions for s in self.samples),
            "num_devices": self.num_devices,
            "mode": self.mode,
            "context_len": self.context_len,
            "decode_steps": self.decode_steps,
        }
        drafts, drafted, accepted = (sum(s.spec_drafts[i] for s in self.samples) for i in range(3))
        if drafts:
            d["spec_num_drafts"], d["spec_num_draft_tokens"], d["spec_num_accepted_tokens"] = \
                drafts, drafted, accepted
            d["spec_acceptance_rate"] = accepted / drafted
            d["spec_mean_accepted_length"] = 1.0 + accepted / drafts
        kv = [s.kv_context for s in self.samples if s.kv_context is not None]
        if kv:
            d["kv_context_min"] = min(k[0] for k in kv)
            d["kv_context_max"] = max(k[1] for k in kv)
        for key in ("output_throughput", "total_token_throughput", "requests_per_second"):
            d[f"{key}_per_device"] = d[key] / self.num_devices
        # vLLM `bench throughput` JSON names, for tools that read those.
        d["tokens_per_second"] = d["total_token_throughput"]
        return d


def ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float]:
    """ours / peer for each rate; > 1 means openinfer is faster."""
    keys = ("output_throughput", "total_token_throughput", "requests_per_second")
    return {k: ours[k] / peer[k] for k in keys}


def new_result(command: list[str], environment_: dict[str, Any], workload: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
        "environment": environment_,
        "workload": workload,
        "engines": {},
        "points": [],
        "notes": [],
    }


def add_point(result: dict[str, Any], summary: dict[str, Any]) -> None:
    """Insert one engine's summary into the row for its batch size, recomputing the ratio when both exist."""
    b = summary["batch_size"]
    row = next((p for p in result["points"] if p["batch_size"] == b), None)
    if row is None:
        row = {"batch_size": b, "openinfer": None, "hf": None, "ratio_openinfer_over_hf": None}
        result["points"].append(row)
        result["points"].sort(key=lambda p: p["batch_size"])
    row[summary["engine"]] = summary
    if row["openinfer"] and row["hf"]:
        row["ratio_openinfer_over_hf"] = ratios(row["openinfer"], row["hf"])


def model_info(path: str) -> dict[str, Any]:
    """Path, architecture and parameter count read from the checkpoint files (no weights loaded)."""
    from safetensors import safe_open

    from openinfer.gguf_file import find_gguf, gguf_config, open_gguf

    p = Path(path)
    gguf = find_gguf(p)
    if gguf is not None:
        cfg = gguf_config(gguf)
        n = sum(int(t.n_elements) for t in open_gguf(gguf).tensors)
        return {"path": str(gguf.resolve()), "architecture": cfg["architectures"][0], "num_params": n,
                "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
                "num_hidden_layers": cfg["num_hidden_layers"], "checkpoint_dtype": "gguf",
                "gguf_bytes": gguf.stat().st_size}
    cfg = json.loads((p / "config.json").read_text())
    if isinstance(cfg.get("text_config"), dict):  # multimodal layout (DeepSeek-V4.1): the LM's fields are nested
        cfg = {**cfg, **cfg["text_config"]}
    n = 0
    for f in sorted(p.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                n += math.prod(st.get_slice(k).get_shape())
    return {"path": str(p.resolve()), "architecture": (cfg.get("architectures") or [""])[0],
            "num_params": n, "vocab_size": int(cfg["vocab_size"]),
            "hidden_size": cfg.get("hidden_size"), "num_hidden_layers": cfg.get("num_hidden_layers"),
            "checkpoint_dtype": cfg.get("torch_dtype") or cfg.get("dtype")}


def print_table(result: dict[str, Any]) -> None:
    has_hf = any(p.get("hf") for p in result["points"])
    w = result["workload"]
    if w.get("mode") == "decode":
        print(f"\nDecode throughput, context {w['context_len']} tokens, {w['decode_steps']} timed decode "
              f"steps, median of {w['num_iters']} (min-max); prefill untimed")
    else:
        print(f"\nThroughput, input {w['input_len']} / output {w['output_len']} tokens, "
              f"median of {w['num_iters']} "
              f"(min-max); output tok/s include prefill")
    head = f"{'batch':>5} | {'openinfer out tok/s':>26} | {'total tok/s':>11} | {'req/s':>7} | {'TTFT ms':>8}"
    if has_hf:
        head += f" | {'HF out tok/s':>26} | {'TTFT ms':>8} | {'ours/HF':>7}"
    print(head)
    print("-" * len(head))

    def cell(s: dict[str, Any] | None) -> str:
        if not s:
            return f"{'-':>26}"
        spread = f"({s['output_throughput_min']:.1f}-{s['output_throughput_max']:.1f})"
        return f"{s['output_throughput']:>9.1f} {spread}".rjust(26)

    def ttft(s: dict[str, Any] | None) -> str:
        return f"{s['mean_ttft_ms']:>8.1f}" if s and s.get("mean_ttft_ms") is not None else f"{'-':>8}"

    for p in result["points"]:
        o = p.get("openinfer")
        line = f"{p['batch_size']:>5} | {cell(o)} | "
        line += f"{o['total_token_throughput']:>11.1f} | {o['requests_per_second']:>7.3f} | " if o else \
            f"{'-':>11} | {'-':>7} | "
        line += ttft(o)
        if has_hf:
            r = p.get("ratio_openinfer_over_hf")
            line += f" | {cell(p.get('hf'))} | {ttft(p.get('hf'))} | "
            line += f"{r['output_throughput']:>6.2f}x" if r else f"{'-':>7}"
        print(line)
    for note in result.get("notes", []):
        print(f"note: {note}")
