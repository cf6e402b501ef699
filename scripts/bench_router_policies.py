"""Load-balancing policies side by side on the agentic replay (issue 12): for each policy, ``openinfer router``
starts N fresh workers behind vllm-router, ``openinfer bench serve --workload agentic`` replays the same
synthetic trace (same seed, same salt) through the router, and the workers' own /metrics give the prefix-cache
hit rate (queries and hits summed over workers, before/after). Policies run in rounds (A B A B ...) so drift on a
shared box hits them alike; every run is kept, and the summary has per-policy medians.

    python scripts/bench_router_policies.py --model .bench/llama-30m --policies round_robin cache_aware \\
        --rounds 2 --out benchmarks/results/router-policies/policies.json -- --synthetic-sessions 8 ...

Arguments after ``--`` go to ``openinfer bench serve`` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]


def prefix_cache(url: str) -> tuple[float, float]:
    """(queries, hits) in tokens, from one worker's /metrics."""
    sums = {"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        name = fam.name.partition(":")[2]
        if name in sums:
            sums[name] += sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return sums["prefix_cache_queries"], sums["prefix_cache_hits"]


def requests_served(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name.endswith(":request_success_total"))


def run_policy(args: argparse.Namespace, policy: str, bench_args: list[str], out_dir: Path, tag: str) -> dict:
    port = 31000 + os.getpid() % 1000
    cmd = [sys.executable, "-m", "openinfer", "router", "--start-workers", str(args.workers), "--model", args.model,
           "--worker-args", args.worker_args, "--policy", policy, "--port", str(port),
           "--startup-timeout-s", "900"]
    if policy == "kv_aware":
        cmd.append("--kv-events")
    log = open(out_dir / f"launcher-{tag}.log", "w")
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        info = json.loads(launcher.stdout.readline())
        workers = info["workers"]
        before = [prefix_cache(w) for w in workers]
        with tempfile.TemporaryDirectory() as tmp:
            bench = [sys.executable, "-m", "openinfer", "bench", "serve", "--workload", "agentic",
                     "--base-url", info["router"], "--save-result", "--result-dir", tmp,
                     "--result-filename", "r.json", "--label", policy, *bench_args]
            t0 = time.monotonic()
            subprocess.run(bench, cwd=REPO, check=True, stdout=open(out_dir / f"bench-{tag}.log", "w"),
                           stderr=subprocess.STDOUT)
            wall = time.monotonic() - t0
            report = json.loads(Path(tmp, "r.json").read_text())
        after = [prefix_cache(w) for w in workers]
        served = [requests_served(w) for w in workers]
        # What the router says it did (kv_aware: index lookups; every policy: decisions per worker).
        router_metrics = [line for line in httpx.get(info["router_metrics"], timeout=30).text.splitlines()
                          if line.startswith(("vllm_router_kv_", "vllm_router_policy_decisions"))]
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(60)
        log.close()
    queries = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    return {
        "policy": policy,
        "run": tag,
        "wall_s": round(wall, 1),
        "completed": report["completed"],
        "failed": report["failed"],
        "prefix_hit_rate_workers": hits / queries if queries else None,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "requests_per_worker": served,
        "cached_hit_rate_usage": report.get("measured_cache_hit_rate_usage"),
        "theoretical_hit_rate": report.get("theoretical_cache_hit_rate"),
        "ttft_ms_p50": report["ttft_ms"]["p50"],
        "ttft_ms_p90": report["ttft_ms"]["p90"],
        "e2el_ms_p50": report["e2el_ms"]["p50"],
        "total_token_throughput": report["total_token_throughput"],
        "router_metrics": router_metrics,
    }


def main() -> None:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--worker-args", default="")
    ap.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--first-round", type=int, default=0, help="number of the first round (names the log files)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = []
    for r in range(args.first_round, args.first_round + args.rounds):
        for policy in args.policies:
            res = run_policy(args, policy, bench_args, out.parent, f"{policy}-{r}")
            print(json.dumps(res), flush=True)
            runs.append(res)
    summary = {}
    for policy in args.policies:
        mine = [x for x in runs if x["policy"] == policy]
        summary[policy] = {k: statistics.median(x[k] for x in mine)
                           for k in ("prefix_hit_rate_workers", "ttft_ms_p50", "ttft_ms_p90", "e2el_ms_p50",
                                     "total_token_throughput")}
    result = {"model": args.model, "workers": args.workers, "worker_args": args.worker_args,
              "bench_args": bench_args, "rounds": args.rounds, "summary": summary, "runs": runs}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
