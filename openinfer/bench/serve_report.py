"""Turn per-request results into vLLM's metrics, result block and JSON fields (``vllm bench serve``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from openinfer.bench.metrics import p_word, peak_concurrency_per_second, peak_per_second, summarize_ms
from openinfer.bench.serve_client import RequestResult

METRIC_NAMES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float],
    goodput_ms: dict[str, float] | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> dict[str, Any]:
    """vLLM's ``calculate_metrics``: only successful requests count toward token totals and latencies."""
    output_lens: list[int] = []
    total_input = completed = good = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    token_times: list[float] = []
    intervals: list[tuple[float, float]] = []
    for r in results:
        if not r.success:
            output_lens.append(0)
            continue
        n_out = r.output_tokens or (count_tokens(r.generated_text) if count_tokens else len(r.itl) + 1)
        output_lens.append(n_out)
        total_input += r.prompt_len
        tpot = (r.latency - r.ttft) / (n_out - 1) if n_out > 1 else 0.0
        if n_out > 1:
            tpots.append(tpot)
        itls.extend(r.itl)
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        completed += 1
        t = r.start_time + r.ttft
        token_times.append(t)
        for gap in r.itl:
            t += gap
            token_times.append(t)
        intervals.append((r.start_time, r.start_time + r.latency))
        if goodput_ms:
            checks = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
            good += all(checks[k] * 1000.0 <= v for k, v in goodput_ms.items())
    origin = min((s for s, _ in intervals), default=0.0)
    total_output = sum(output_lens)
    m: dict[str, Any] = {
        "completed": completed,
        "failed": len(results) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": good / duration_s if goodput_ms else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_per_second(token_times, origin),
        "max_concurrent_requests": peak_concurrency_per_second(intervals, origin),
        "output_lens": output_lens,
    }
    for key, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        for stat, v in summarize_ms(values, percentiles).items():
            m[f"{stat}_{key}_ms"] = v
    return m


def format_block(
    m: dict[str, Any],
    duration_s: float,
    max_concurrency: int | None,
    request_rate: float,
    metrics: Sequence[str],
    percentiles: Sequence[float],
    goodput: bool,
) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(("{:<40} {:<10" + fmt + "}").format(label, value))

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", duration_s, ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    if goodput:
        row("Request goodput (req/s):", m["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", m["max_concurrent_requests"], ".2f")
    row("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f")
    for key in metrics:
        name, header = METRIC_NAMES[key]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", m[f"mean_{key}_ms"], ".2f")
        row(f"Median {name} (ms):", m[f"median_{key}_ms"], ".2f")
        for p in percentiles:
            row(f"P{p_word(p)} {name} (ms):", m[f"p{p_word(p)}_{key}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def result_json(
    m: dict[str, Any],
    results: Sequence[RequestResult],
    metrics: Sequence[str],
    percentiles: Sequence[float],
    detailed: bool,
    header: dict[str, Any],
    duration_s: float,
) -> dict[str, Any]:
    """vLLM's saved fields; per-request lists only with ``detailed`` (vLLM's ``--save-detailed``)."""
    out = dict(header)
    out.update(
        {
            k: m[k]
            for k in (
                "completed",
                "failed",
                "total_input_tokens",
                "total_output_tokens",
                "request_throughput",
                "request_goodput",
                "output_throughput",
                "total_token_throughput",
                "max_output_tokens_per_s",
                "max_concurrent_requests",
            )
        }
    )
    out["duration"] = duration_s
    for key in metrics:
        for stat in ("mean", "median", "std"):
            out[f"{stat}_{key}_ms"] = m[f"{stat}_{key}_ms"]
        for p in percentiles:
            out[f"p{p_word(p)}_{key}_ms"] = m[f"p{p_word(p)}_{key}_ms"]
    if detailed:
        out["input_lens"] = [r.prompt_len for r in results]
        out["output_lens"] = m["output_lens"]
        out["ttfts"] = [r.ttft for r in results]
        out["itls"] = [r.itl for r in results]
        out["latencies"] = [r.latency for r in results]
        out["start_times"] = [r.start_time for r in results]
        out["generated_texts"] = [r.generated_text for r in results]
        out["errors"] = [r.error for r in results]
    return out


def add_metadata(header: dict, items: list[str] | None) -> None:
    """``--metadata KEY=VALUE ...`` into the result header."""
    for kv in items or []:
        key, sep, value = kv.partition("=")
        if not sep:
            raise ValueError(f"--metadata entries look like KEY=VALUE, got {kv!r}")
        header[key] = value


def save_result(result: dict, result_dir: str, filename: str) -> Path:
    path = Path(result_dir) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"Saved results to {path}")
    return path
