"""The agentic multi-turn bench against DeepSeek's production shape at toy scale (issue 41's must-show 3): a prefill
instance (DP 2 + EP) and a decode instance (DP 2 + EP, MTP k = 2) behind the unmodified vllm-router, against one
monolithic instance on the same number of ranks (DP 4 + EP, MTP k = 2). Every setup gets fresh processes on
127.0.0.1, a short warm-up replay (its own filler salt, kept out of every figure), then the same synthetic AgentX-style
trace (same seed, same salt) through ``openinfer bench serve --workload agentic``; the servers' and the router's
/metrics are read before and after the measured replay, so the client's figures and the servers' cover the same
requests.

    python scripts/train_tiny_mtp.py --out .bench/dsv3-mtp-tiny --steps 400      # a tiny V3 with a trained MTP layer
    python scripts/pd_agentic_bench.py --model .bench/dsv3-mtp-tiny --out docs/results/pd_agentic

Without ``--model`` a random tiny V3 with one MTP layer is written (its drafts are accepted by chance only). Writes
OUT/summary.json (settings, per setup: the client's report figures, the servers' /metrics deltas, the time split)
and OUT/summary.md; each replay's full bench result goes to OUT/<setup>.json, the picture to OUT/pd_agentic.png.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
PREFIX = "openinfer:"
SPEC = {"method": "mtp", "num_speculative_tokens": 2}
KV = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
# setup name -> (what it is, instances: (role, data_parallel_size, send_type or None without a connector))
SETUPS = {
    "monolithic": ("one instance, DP 4 + EP, MTP k = 2", [("mono", 4, None)]),
    "pd": ("prefill DP 2 + EP -> decode DP 2 + EP, MTP k = 2, vllm-router, NIXL pull",
           [("prefill", 2, "GET"), ("decode", 2, "GET")]),
    "pd-push": ("as pd, the decoder asks the prefill instance to push (NIXL WRITE)",
                [("prefill", 2, "GET"), ("decode", 2, "PUT")]),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="DeepSeek-V3-shaped checkpoint with an MTP layer (default: a random "
                    "tiny one)")
    ap.add_argument("--out", default="docs/results/pd_agentic")
    ap.add_argument("--setups", nargs="+", default=["monolithic", "pd"], help=f"of {', '.join(SETUPS)}")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--num-kv-blocks", type=int, default=256, help="per data-parallel replica (16 tokens each)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--first-len", default="128:256")
    ap.add_argument("--turn-len", default="32:96")
    ap.add_argument("--output-len", default="24:48")
    ap.add_argument("--concurrency", type=int, default=4, help="live sessions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="run the setups this many times, interleaved (a shared "
                    "host's load drifts: each setup meets it more than once)")
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a server to answer /health")
    ap.add_argument("--bench-timeout", type=float, default=1800.0, help="seconds for one replay")
    ap.add_argument("--router", default=None, help="vllm-router binary (default: next to this Python, else PATH)")
    args = ap.parse_args(argv)
    bad = [s for s in args.setups if s not in SETUPS]
    if bad:
        ap.error(f"--setups: unknown {bad}; choose from {list(SETUPS)}")
    for name in ("sessions", "turns", "concurrency", "max_model_len", "num_kv_blocks", "max_num_seqs", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_binary(args: argparse.Namespace) -> str:
    path = args.router or str(Path(sys.executable).parent / "vllm-router")
    if not Path(path).exists():
        path = shutil.which("vllm-router") or ""
    if not path:
        raise SystemExit("vllm-router is not installed (pip install 'openinfer[pd]')")
    return path


def server_cmd(model: str | Path, port: int, dp: int, send_type: str | None, args: argparse.Namespace) -> list[str]:
    """One ``openinfer serve``: DP ``dp`` + EP with MTP k = 2; with ``send_type`` the NIXL connector. The prefill
    instance runs the decoder's speculative_config too: its prompt pass fills the MTP layer's KV, which moves with
    the target's (docs/composition.md)."""
    cmd = [sys.executable, "-m", "openinfer", "serve", "--model", str(model), "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", "m", "--dtype", "float32", "--max-model-len", str(args.max_model_len),
           "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.max_num_seqs), "--block-size",
           "16", "--data-parallel-size", str(dp), "--enable-expert-parallel", "--speculative-config",
           json.dumps(SPEC)]
    if send_type is not None:
        kv = {**KV, "kv_connector_extra_config": {"send_type": send_type}} if send_type == "PUT" else KV
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return cmd


def router_cmd(binary: str, prefill_url: str, decode_url: str, port: int, prom_port: int) -> list[str]:
    return [binary, "--vllm-pd-disaggregation", "--prefill", prefill_url, "--decode", decode_url, "--host",
            "127.0.0.1", "--port", str(port), "--worker-startup-check-interval", "1", "--request-timeout-secs",
            "600", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port)]


def bench_cmd(url: str, args: argparse.Namespace, tokenizer: str | Path, *, salt: str, sessions: int, turns: int,
              warmup: bool, out: Path | None = None, name: str | None = None) -> list[str]:
    """The replay: completions with token-id prompts, greedy, no think time (turn k+1 leaves when turn k ends)."""
    cmd = [sys.executable, "-m", "openinfer", "bench", "serve", "--workload", "agentic", "--base-url", url,
           "--model", "m", "--tokenizer", str(tokenizer), "--seed", str(args.seed), "--synthetic-sessions",
           str(sessions), "--synthetic-turns", str(turns), "--synthetic-first-len", args.first_len,
           "--synthetic-turn-len", args.turn_len, "--synthetic-output-len", args.output_len,
           "--synthetic-max-context", str(args.max_model_len), "--concurrency", str(min(args.concurrency, sessions)),
           "--no-think-time", "--salt", salt, "--agentic-warmup-turns", "0", "--stall-timeout", "300",
           "--ready-check-timeout-sec", "60"]
    if not warmup:
        cmd += ["--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", f"{name}.json"]
    return cmd


def num_ranks(setup: str) -> int:
    return sum(dp for _, dp, _ in SETUPS[setup][1])


# -- /metrics ---------------------------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name[{label=value,...}]: value}, model_name dropped (one model per server)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "le"))
            if "le" in s.labels:  # histogram buckets: not needed here (sum and count are)
                continue
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def scrape(url: str) -> dict[str, float]:
    r = httpx.get(url, timeout=30)
    r.raise_for_status()
    return parse_metrics(r.text)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _mean_ms(d: dict[str, float], hist: str) -> float | None:
    n = d.get(f"{PREFIX}{hist}_count", 0.0)
    return 1000.0 * d[f"{PREFIX}{hist}_sum"] / n if n else None


def server_figures(d: dict[str, float]) -> dict[str, float | None]:
    """One instance's share of the work over the measured replay (deltas of its /metrics)."""
    src = {s: d.get(f'{PREFIX}prompt_tokens_by_source_total{{source={s}}}', 0.0)
           for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    prompt = sum(src.values())
    loads = d.get(PREFIX + "kv_transfer_loads_total", 0.0)
    drafts = d.get(PREFIX + "spec_decode_num_drafts_total", 0.0)
    draft_tokens = d.get(PREFIX + "spec_decode_num_draft_tokens_total", 0.0)
    accepted = d.get(PREFIX + "spec_decode_num_accepted_tokens_total", 0.0)
    return {
        "requests": d.get(PREFIX + "e2e_request_latency_seconds_count", 0.0),
        "prompt_tokens": prompt,
        "prompt_tokens_computed": src["local_compute"],
        "prompt_tokens_cache_hit": src["local_cache_hit"],
        "prompt_tokens_received": src["external_kv_transfer"],
        "cached_share": src["local_cache_hit"] / prompt if prompt else None,
        "generation_tokens": d.get(PREFIX + "engine_generation_tokens_total", 0.0),
        "engine_steps": d.get(PREFIX + "engine_steps_total", 0.0),
        "preemptions": d.get(PREFIX + "num_preemptions_total", 0.0),
        "kv_loads": loads,
        "kv_fallbacks": d.get(PREFIX + "kv_transfer_fallbacks_total", 0.0),
        "kv_bytes": d.get(PREFIX + "kv_transfer_bytes_total", 0.0),
        "kv_seconds": d.get(PREFIX + "kv_transfer_seconds_total", 0.0),
        "kv_sends": d.get(PREFIX + "kv_transfer_sends_total", 0.0),
        "kv_read_ms_mean": 1000.0 * d.get(PREFIX + "kv_transfer_seconds_total", 0.0) / loads if loads else None,
        "spec_drafts": drafts,
        "spec_draft_tokens": draft_tokens,
        "spec_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "spec_mean_accepted_length": 1.0 + accepted / drafts if drafts else None,
        "queue_ms_mean": _mean_ms(d, "request_queue_time_seconds"),
        "ttft_ms_mean": _mean_ms(d, "time_to_first_token_seconds"),
        "e2e_ms_mean": _mean_ms(d, "e2e_request_latency_seconds"),
        "itl_ms_mean": _mean_ms(d, "inter_token_latency_seconds"),
    }


def time_split(client: dict, servers: dict[str, dict]) -> dict[str, float | None]:
    """Where a request's time goes, mean ms per request. Client TTFT = router and HTTP hops + the prefill
    instance's whole answer (its queue + the prompt pass) + the decoder's time to its first token (the KV read, then
    the last prompt token recomputed); monolithic: HTTP + queue + prompt pass. Decode = client E2EL - TTFT."""
    ttft, e2el = client["ttft_ms"]["mean"], client["e2el_ms"]["mean"]
    out: dict[str, float | None] = {"client_ttft": ttft, "decode": e2el - ttft}

    def sub(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    if "mono" in servers:
        m = servers["mono"]
        out.update(queue=m["queue_ms_mean"], prompt_pass=sub(m["ttft_ms_mean"], m["queue_ms_mean"]),
                   http=sub(ttft, m["ttft_ms_mean"]))
        return out
    p, d = servers["prefill"], servers["decode"]
    out.update(prefill_queue=p["queue_ms_mean"], prompt_pass=sub(p["ttft_ms_mean"], p["queue_ms_mean"]),
               prefill_answer_back=sub(p["e2e_ms_mean"], p["ttft_ms_mean"]), kv_read=d["kv_read_ms_mean"],
               decoder_first_token=sub(d["ttft_ms_mean"], d["kv_read_ms_mean"]),
               router_and_http=sub(sub(ttft, p["e2e_ms_mean"]), d["ttft_ms_mean"]))
    return out


# -- processes --------------------------------------------------------------------------------------------------
class Deployment:
    def __init__(self) -> None:
        self.url = ""
        self.metrics: dict[str, str] = {}  # role -> /metrics URL
        self.procs: list[subprocess.Popen] = []

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}; log: {log}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not up after {timeout_s:.0f} s; log: {log}")
        time.sleep(0.5)


def launch(setup: str, model: Path, args: argparse.Namespace, logs: Path, tag: str) -> Deployment:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    dep = Deployment()
    urls: dict[str, str] = {}
    try:
        started = []
        for role, dp, send_type in SETUPS[setup][1]:
            port = free_port()
            log = logs / f"{tag}-{role}.log"
            proc = subprocess.Popen(server_cmd(model, port, dp, send_type, args), cwd=REPO, env=env,
                                    stdout=open(log, "w"), stderr=subprocess.STDOUT)
            dep.procs.append(proc)
            started.append((role, f"http://127.0.0.1:{port}", proc, log))
        for role, url, proc, log in started:  # started together, waited on one by one
            wait_http(url + "/health", proc, args.startup_timeout, log)
            urls[role] = url
            dep.metrics[role] = url + "/metrics"
        if "mono" in urls:
            dep.url = urls["mono"]
            return dep
        port, prom = free_port(), free_port()
        log = logs / f"{tag}-router.log"
        router = subprocess.Popen(router_cmd(router_binary(args), urls["prefill"], urls["decode"], port, prom),
                                  stdout=open(log, "w"), stderr=subprocess.STDOUT)
        dep.procs.append(router)
        dep.url = f"http://127.0.0.1:{port}"
        wait_http(dep.url + "/health", router, 120, log)
        dep.metrics["router"] = f"http://127.0.0.1:{prom}/metrics"
        return dep
    except BaseException:
        dep.stop()
        raise


def router_figures(d: dict[str, float]) -> dict[str, float]:
    """vllm-router's own counters and latency sums that moved during the replay (names as it exports them)."""
    return {k: v for k, v in sorted(d.items()) if v and not k.startswith(("process_", "python_"))}


def run_names(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(run name, setup) in the order they run: the setups in turn, ``--repeats`` rounds."""
    if args.repeats == 1:
        return [(s, s) for s in args.setups]
    return [(f"{s} #{r + 1}", s) for r in range(args.repeats) for s in args.setups]


def run_setup(name: str, setup: str, model: Path, args: argparse.Namespace, out: Path, logs: Path) -> dict:
    t0 = time.monotonic()
    load_before = os.getloadavg()[0]
    stem = name.replace(" #", "-")
    dep = launch(setup, model, args, logs, stem)
    try:
        startup_s = time.monotonic() - t0
        warm = bench_cmd(dep.url, args, model, salt="pd-agentic-warmup", sessions=min(2, args.sessions), turns=1,
                         warmup=True)
        subprocess.run(warm, check=True, cwd=REPO, stdout=subprocess.DEVNULL, timeout=args.bench_timeout)
        before = {role: scrape(u) for role, u in dep.metrics.items()}
        cmd = bench_cmd(dep.url, args, model, salt="pd-agentic", sessions=args.sessions, turns=args.turns,
                        warmup=False, out=out, name=stem)
        t1 = time.monotonic()
        subprocess.run(cmd, check=True, cwd=REPO, stdout=open(logs / f"{stem}-bench.log", "w"),
                       timeout=args.bench_timeout)
        replay_s = time.monotonic() - t1
        time.sleep(1.0)  # the last requests' counters (a held prompt freed by its reader) land after the answer
        after = {role: scrape(u) for role, u in dep.metrics.items()}
    finally:
        dep.stop()
    report = json.loads((out / f"{stem}.json").read_text())
    report.pop("requests", None)  # kept in OUT/<setup>.json; the summary keeps the aggregates
    deltas = {role: delta(before[role], after[role]) for role in before}
    servers = {role: server_figures(d) for role, d in deltas.items() if role != "router"}
    return {
        "setup": setup, "layout": SETUPS[setup][0], "ranks": num_ranks(setup), "startup_s": startup_s,
        "replay_s": replay_s, "host_load_1min": [load_before, os.getloadavg()[0]],  # before launch, after the replay
        "client": {k: report[k] for k in (
            "completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
            "output_throughput", "total_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms",
            "theoretical_cache_hit_rate", "measured_cache_hit_rate_usage", "validity")},
        "servers": servers,
        "router": router_figures(deltas["router"]) if "router" in deltas else None,
        "time_split_ms": time_split(report, servers),
    }


# -- outputs ----------------------------------------------------------------------------------------------------
def cached_share(r: dict) -> float | None:
    """Prompt tokens whose KV this deployment did not compute, over all prompt tokens: the prefix cache of the
    instance that runs prompts (the prefill instance in PD; the decoder's own hits only save transfer bytes)."""
    s = r["servers"].get("mono") or r["servers"]["prefill"]
    return s["cached_share"]


def markdown(results: dict) -> str:
    lines = ["| setup | ranks | tok/s (in+out) | out tok/s | TTFT p50 / p90 ms | TPOT p50 / p90 ms | cached share "
             "(server) | MTP accepted / drafted | decoder prompt tokens received / local hit | KV bytes moved | "
             "failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        c = r["client"]
        dec = r["servers"].get("mono") or r["servers"]["decode"]
        d = r["servers"].get("decode")
        kv = None if d is None else d["kv_bytes"]
        recv = "-" if d is None else f"{d['prompt_tokens_received']:.0f} / {d['prompt_tokens_cache_hit']:.0f}"
        lines.append(
            f"| {name} | {r['ranks']} | {c['total_token_throughput']:.1f} | {c['output_throughput']:.1f} | "
            f"{c['ttft_ms']['p50']:.0f} / {c['ttft_ms']['p90']:.0f} | {c['tpot_ms']['p50']:.1f} / "
            f"{c['tpot_ms']['p90']:.1f} | {_pct(cached_share(r))} | {dec['spec_accepted_tokens']:.0f} / "
            f"{dec['spec_draft_tokens']:.0f} | {recv} | {'-' if kv is None else f'{kv:,.0f}'} | {c['failed']} |")
    lines += ["", "Where a request's time goes (mean ms per request, measured replay only):", "",
              "| setup | " + " | ".join(_SPLIT_NAMES.values()) + " |", "|---" * (len(_SPLIT_NAMES) + 1) + "|"]
    for name, r in results.items():
        t = r["time_split_ms"]
        lines.append(f"| {name} | " + " | ".join(_ms(t.get(k)) for k in _SPLIT_NAMES) + " |")
    return "\n".join(lines) + "\n"


_SPLIT_NAMES = {"client_ttft": "client TTFT", "http": "HTTP", "router_and_http": "router + HTTP",
                "queue": "queue", "prefill_queue": "prefill queue", "prompt_pass": "prompt pass",
                "prefill_answer_back": "prefill answer", "kv_read": "KV read",
                "decoder_first_token": "decoder first token (not read)", "decode": "decode"}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        for i, n in enumerate(names):
            c = results[n]["client"][key]
            ax.bar([i - 0.2, i + 0.2], [c["p50"], c["p90"]], width=0.4, color=["#4c72b0", "#dd8452"])
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title + ": p50 (blue), p90 (orange)")
    ax, seen = axes[2], set()
    for i, n in enumerate(names):
        t, left = results[n]["time_split_ms"], 0.0
        for j, k in enumerate(k for k in _SPLIT_NAMES if k != "client_ttft"):
            v = t.get(k)
            if v and v > 0:  # a negative remainder (clock skew between processes) is not drawn
                ax.barh(i, v, left=left, color=plt.cm.tab10(j), label=None if k in seen else _SPLIT_NAMES[k])
                seen.add(k)
                left += v
    ax.set_yticks(range(len(names)), names)
    ax.set_title("mean request: where the time goes (ms)")
    ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("agentic multi-turn replay, tiny DeepSeek-V3 + MTP k = 2, 4 ranks per setup, 2-core CPU host")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def make_random_checkpoint(path: Path) -> Path:
    sys.path.insert(0, str(REPO / "scripts"))
    import make_deepseek_checkpoint

    return make_deepseek_checkpoint.make_v3(path, "tiny", seed=0, overrides={"num_nextn_predict_layers": 1,
                                                                              "max_position_embeddings": 1024})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="pd-agentic-"))
    model = Path(args.model).resolve() if args.model else make_random_checkpoint(tmp / "v3")
    print(f"model {model}; server and router logs in {tmp}", flush=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("router",)}
    settings["model_config"] = json.loads((model / "config.json").read_text())
    settings["trained_mtp"] = args.model is not None
    results = {}
    for name, setup in run_names(args):
        results[name] = run_setup(name, setup, model, args, out, tmp)
        c = results[name]["client"]
        print(f"{name}: {c['completed']} done, {c['total_token_throughput']:.1f} tok/s, TTFT p50 "
              f"{c['ttft_ms']['p50']:.0f} ms, TPOT p50 {c['tpot_ms']['p50']:.1f} ms", flush=True)
        write_outputs(results, settings, out)  # after every run: a long sweep's finished runs are kept
    print((out / "summary.md").read_text())


def write_outputs(results: dict, settings: dict, out: Path) -> None:
    (out / "summary.json").write_text(json.dumps({"settings": settings, "results": results}, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(results))
    plot(results, out / "pd_agentic.png")


if __name__ == "__main__":
    main()
