"""Aggregate an agentic replay into AgentX-style metrics (``schema: openinfer.bench.agentic/v1``).

Definitions:
- measured requests = every request sent after its lane's warm-up turns; sent = completed + failed.
- duration = last end - first start over the measured requests.
- input tokens = the server's ``usage.prompt_tokens`` = cached + uncached input (the full prompt, as
  AgentX counts it); throughputs are over the completed measured requests, ``*_per_device`` ÷ num_devices.
- latency blocks (ms): mean, p50, p75, p90, p95, p99, std, percentiles linearly interpolated. TTFT and
  E2EL per request, ITL pooled over every gap, TPOT = (E2EL - TTFT) / (out - 1) per request.
- interactivity pX = 1 / ITL pX (tok/s per user); ``p90_interactivity`` is the slow-tail user.
- cache: theoretical rate from the trace (trace.PrefixCacheModel, unlimited cache) over the completed
  measured requests; usage rate = Σ cached / Σ prompt over the same requests; the /metrics rate is the
  delta of the server's prefix-cache counters over the whole run, warm-up included, so it is compared
  with the usage rate over all completed requests (``measured_cache_hit_rate_usage_all``).
- validity: invalid when the context-overflow rate exceeds 1%, when more than 5% of streams stalled
  (below AgentX's 95% metric coverage), when nothing completed, or when the server's token counts differ
  from the trace (a prompt not ``in`` tokens long, or an answer not ``out`` tokens long despite
  ``ignore_eos``). Other 4xx/5xx errors are counted but do not invalidate, as in AgentX.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from openinfer.bench.agentic.runner import RequestRecord
from openinfer.bench.metrics import summarize_ms

SCHEMA = "openinfer.bench.agentic/v1"
PERCENTILES = (50, 75, 90, 95, 99)
MAX_OVERFLOW_RATE = 0.01
MAX_STALLED_RATE = 0.05


def latency_block(values_s: Sequence[float]) -> dict[str, float]:
    s = summarize_ms(values_s, PERCENTILES)
    return {k: s[k] for k in ("mean", "p50", "p75", "p90", "p95", "p99", "std")}


def _rate(num: float, den: float) -> float | None:
    return num / den if den else None


def build_report(
    requests: Sequence[RequestRecord],
    num_devices: int,
    metrics_before: tuple[float, float] | None,
    metrics_after: tuple[float, float] | None,
    header: dict[str, Any] | None = None,
    detailed: bool = False,
) -> dict[str, Any]:
    if num_devices < 1:
        raise ValueError(f"--num-devices must be >= 1, got {num_devices}")
    measured = [q for q in requests if not q.warmup]
    done = [q for q in measured if q.result.success]
    failed = [q for q in measured if not q.result.success]
    duration = (
        max(q.result.end for q in measured) - min(q.result.start for q in measured) if measured else 0.0
    )
    cached = sum(q.result.cached_tokens for q in done)
    prompt = sum(q.result.prompt_tokens for q in done)
    uncached = sum(q.result.uncached_tokens for q in done)
    output = sum(q.result.output_tokens for q in done)
    categories = Counter(q.result.category for q in failed)

    def tput(tokens: int) -> float:
        return tokens / duration if duration > 0 else 0.0

    itls = [g for q in done for g in q.result.itl]
    tpots = [
        (q.result.latency - q.result.ttft) / (q.result.output_tokens - 1)
        for q in done
        if q.result.output_tokens > 1
    ]
    lat = {
        "ttft": latency_block([q.result.ttft for q in done]),
        "itl": latency_block(itls),
        "tpot": latency_block(tpots),
        "e2el": latency_block([q.result.latency for q in done]),
    }
    # tok/s per user; None when no gap was measured (every answer one token long)
    intvty = {
        f"p{p}": (1000.0 / lat["itl"][f"p{p}"] if itls and lat["itl"][f"p{p}"] > 0 else None)
        for p in PERCENTILES
    }
    all_done = [q for q in requests if q.result.success]
    metrics_rate = None
    if metrics_before is not None and metrics_after is not None:
        metrics_rate = _rate(metrics_after[1] - metrics_before[1], metrics_after[0] - metrics_before[0])

    sent = len(measured)
    overflow = categories.get("context_overflow", 0)
    stalled = categories.get("stalled", 0)
    prompt_mismatch = sum(q.result.prompt_tokens != q.record.input_len for q in done)
    output_mismatch = sum(q.result.output_tokens != q.record.output_len for q in done)
    reasons = []
    if not done:
        reasons.append("no measured request completed")
    if sent and overflow / sent > MAX_OVERFLOW_RATE:
        reasons.append(f"context-overflow rate {overflow / sent:.2%} > {MAX_OVERFLOW_RATE:.0%}")
    if sent and stalled / sent > MAX_STALLED_RATE:
        reasons.append(f"stalled streams {stalled / sent:.2%} > {MAX_STALLED_RATE:.0%} (coverage < 95%)")
    if prompt_mismatch:
        reasons.append(f"{prompt_mismatch} completed prompts were not the trace's 'in' tokens long")
    if output_mismatch:
        reasons.append(f"{output_mismatch} completed answers were not the trace's 'out' tokens long")

    out: dict[str, Any] = dict(header or {})
    out.update(
        {
            "schema": SCHEMA,
            "num_devices": num_devices,
            "duration": duration,
            "sent": sent,
            "completed": len(done),
            "failed": len(failed),
            "request_accounting": {
                "requests_sent_total": len(requests),
                "records_warmup_dropped": len(requests) - sent,
                "records_error_dropped": len(failed),
                "error_categories": dict(sorted(categories.items())),
            },
            "total_input_tokens": prompt,
            "cached_input_tokens": cached,
            "uncached_input_tokens": uncached,
            "total_output_tokens": output,
            "expected_input_tokens": sum(q.record.input_len for q in done),
            "expected_output_tokens": sum(q.record.output_len for q in done),
            "request_throughput": tput(len(done)),
            "input_throughput": tput(prompt),
            "output_throughput": tput(output),
            "total_token_throughput": tput(prompt + output),
            "input_throughput_per_device": tput(prompt) / num_devices,
            "output_throughput_per_device": tput(output) / num_devices,
            "total_token_throughput_per_device": tput(prompt + output) / num_devices,
            **{f"{k}_ms": v for k, v in lat.items()},
            "interactivity": intvty,
            "p90_interactivity": intvty["p90"],
            "median_interactivity": intvty["p50"],
            "theoretical_cache_hit_rate": _rate(
                sum(q.theoretical_hit_tokens for q in done), sum(q.record.input_len for q in done)
            ),
            "measured_cache_hit_rate_usage": _rate(cached, prompt),
            "measured_cache_hit_rate_usage_all": _rate(
                sum(q.result.cached_tokens for q in all_done), sum(q.result.prompt_tokens for q in all_done)
            ),
            "measured_cache_hit_rate_metrics": metrics_rate,
            "validity": {
                "context_overflow_rate": _rate(overflow, sent),
                "error_rate": _rate(len(failed), sent),
                "stalled_streams": stalled,
                "prompt_token_mismatches": prompt_mismatch,
                "output_token_mismatches": output_mismatch,
                "submission_valid": not reasons,
                "reasons": reasons,
            },
        }
    )
    if detailed:
        out["requests"] = [
            {
                "session_id": q.record.session_id,
                "agent": q.record.agent,
                "turn": q.record.turn,
                "lane": q.lane,
                "pass": q.pass_index,
                "warmup": q.warmup,
                "in": q.record.input_len,
                "out": q.record.output_len,
                "theoretical_hit_tokens": q.theoretical_hit_tokens,
                "success": q.result.success,
                "category": q.result.category,
                "error": q.result.error,
                "prompt_tokens": q.result.prompt_tokens,
                "cached_tokens": q.result.cached_tokens,
                "uncached_tokens": q.result.uncached_tokens,
                "output_tokens": q.result.output_tokens,
                "ttft": q.result.ttft,
                "latency": q.result.latency,
                "itl": q.result.itl,
                "start": q.result.start,
                "end": q.result.end,
            }
            for q in requests
        ]
    return out


def format_summary(r: dict[str, Any]) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Agentic Serving Benchmark Result ", n=60, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        if value is None:
            value, fmt = "n/a", ""
        lines.append(("{:<44} {:<14" + fmt + "}").format(label, value))

    acc = r["request_accounting"]
    row("Live sessions (concurrency):", r.get("concurrency", "n/a"))
    row("Requests sent (measured):", r["sent"])
    row("Successful requests:", r["completed"])
    row("Failed requests:", r["failed"])
    row("Warm-up requests dropped:", acc["records_warmup_dropped"])
    if acc["error_categories"]:
        row("Errors by category:", ", ".join(f"{k}={v}" for k, v in acc["error_categories"].items()))
    row("Benchmark duration (s):", r["duration"], ".2f")
    row("Input tokens (cached + uncached):", r["total_input_tokens"])
    row("  cached input tokens:", r["cached_input_tokens"])
    row("  uncached input tokens:", r["uncached_input_tokens"])
    row("Output tokens:", r["total_output_tokens"])
    row("Total token throughput (tok/s):", r["total_token_throughput"], ".2f")
    devices = r["num_devices"]
    row(f"Total tok/s per device ({devices} devices):", r["total_token_throughput_per_device"], ".2f")
    row("Input tok/s per device:", r["input_throughput_per_device"], ".2f")
    row("Output tok/s per device:", r["output_throughput_per_device"], ".2f")
    row("P90 interactivity (tok/s/user):", r["p90_interactivity"], ".2f")
    row("Median interactivity (tok/s/user):", r["median_interactivity"], ".2f")
    lines.append("{s:{c}^{n}}".format(s="Prefix cache", n=60, c="-"))
    row("Theoretical hit rate (trace):", r["theoretical_cache_hit_rate"], ".4f")
    row("Measured hit rate (usage):", r["measured_cache_hit_rate_usage"], ".4f")
    row("Measured hit rate (/metrics, incl. warm-up):", r["measured_cache_hit_rate_metrics"], ".4f")
    for key, name in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"), ("e2el", "E2EL")):
        b = r[f"{key}_ms"]
        lines.append("{s:{c}^{n}}".format(s=f"{name} (ms)", n=60, c="-"))
        row(f"Mean / P50 {name}:", f"{b['mean']:.2f} / {b['p50']:.2f}")
        row(f"P90 / P99 {name}:", f"{b['p90']:.2f} / {b['p99']:.2f}")
    v = r["validity"]
    lines.append("{s:{c}^{n}}".format(s="Validity", n=60, c="-"))
    row("Context-overflow rate:", v["context_overflow_rate"], ".4f")
    row("Error rate:", v["error_rate"], ".4f")
    row("Stalled streams:", v["stalled_streams"])
    row("Submission valid:", "yes" if v["submission_valid"] else "NO: " + "; ".join(v["reasons"]))
    lines.append("=" * 60)
    return "\n".join(lines)
