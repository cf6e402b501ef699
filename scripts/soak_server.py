"""Soak a running ``openinfer serve``: an agentic replay at saturation (bench/agentic: synthetic sessions of
token-id prompts that grow turn by turn, sub-agents, no think time) for ``--duration`` seconds, with random client
cancellations and poison requests (out-of-range fields, oversized bodies, huge stop lists) mixed in.

It reports, as JSON (and a PNG of RSS and KV blocks over time with ``--plot``):

* requests sent / finished / errored / cancelled / lost: lost = no outcome (a stream that stalled past
  ``--stall-timeout``, ended without its usage block, or was still open when the run gave up on it);
* poison requests by kind and status: each must get a 4xx, never a 5xx or no answer;
* leaked KV blocks: blocks still in use (``kv_cache_total_blocks - kv_cache_free_blocks`` on /metrics) once the
  server has gone idle after the run; it must be 0;
* the server's RSS over time (``process_resident_memory_bytes`` on /metrics, sampled every ``--sample-interval``).

Exit code 0 when nothing was lost or leaked and every poison request got a 4xx. Not a CI test (see
tests/test_soak_server.py for a 10-second run); for example:

    python -m openinfer serve --model <small model> --port 8000 &
    python scripts/soak_server.py --url http://127.0.0.1:8000 --tokenizer <model dir> --duration 180 \\
        --out benchmarks/results/soak/soak.json --plot benchmarks/results/soak/soak.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

from openinfer.bench.agentic.client import AgenticResult, stream_completion
from openinfer.bench.agentic.filler import Filler
from openinfer.bench.agentic.runner import AgenticRunner, RequestRecord, RunConfig
from openinfer.bench.agentic.synth import SynthConfig, synthesize

ERRORED = ("http_4xx", "http_5xx", "stream_error", "context_overflow", "transport")
LOST = ("stalled", "incomplete")


# -- poison ---------------------------------------------------------------------------------------------------


def poison_bodies(model: str, max_body_bytes: int) -> dict[str, bytes]:
    """One body per kind of hostile request; every one must be refused with a 4xx."""
    base = {"model": model, "prompt": "poison", "max_tokens": 4}

    def enc(extra: dict) -> bytes:
        return json.dumps({**base, **extra}).encode()

    return {
        "top_k_past_int64": enc({"top_k": 2**64}),
        "stop_token_id_past_vocab": enc({"stop_token_ids": [10**9], "min_tokens": 2}),
        "temperature_negative": enc({"temperature": -1}),
        "max_tokens_huge": enc({"max_tokens": 10**12}),
        "logprobs_huge": enc({"logprobs": 10**6}),
        "n_huge": enc({"n": 10**6}),
        "logit_bias_past_vocab": enc({"logit_bias": {str(10**9): 5}}),
        "prompt_id_past_vocab": enc({"prompt": [10**9]}),
        "huge_stop_list": enc({"stop": [f"s{i}" for i in range(100_000)]}),
        "huge_stop_string": enc({"stop": ["x" * 1_000_000]}),
        "multi_mb_prompt": enc({"prompt": "a" * min(4 * 2**20, max_body_bytes // 2)}),
        "oversized_body": enc({"prompt": "a" * (max_body_bytes + 1024)}),
        "not_json": b'{"model": "' + model.encode() + b'", "prompt": ',
    }


async def send_poison(http: aiohttp.ClientSession, url: str, body: bytes, headers: dict, timeout_s: float) -> str:
    """The HTTP status as a string, or 'lost' when no answer came within ``timeout_s``."""
    try:
        async with http.post(url, data=body, headers={"Content-Type": "application/json", **headers},
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            await r.read()
            return str(r.status)
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
        return "lost"
    except aiohttp.ClientError as e:
        # The server may close the connection on an oversized upload right after its 413: not a lost request
        # when it answered, but aiohttp cannot always read that answer while still sending.
        return f"closed:{type(e).__name__}"


# -- the replay with cancellations ----------------------------------------------------------------------------


class SoakRunner(AgenticRunner):
    """The agentic replay; a random share of requests is cancelled by the client part-way (the connection is
    dropped, as a user hitting stop does). Every request's outcome is recorded in ``outcomes`` (by entry id):
    finished / errored / cancelled / lost; one still open at the end has none and counts as lost."""

    def __init__(self, *a, cancel_prob: float, cancel_max_s: float, rng: random.Random, **kw) -> None:
        super().__init__(*a, **kw)
        self.cancel_prob = cancel_prob
        self.cancel_max_s = cancel_max_s
        self.rng = rng
        self.outcomes: dict[int, str] = {}
        self.categories: Counter[str] = Counter()
        self.first_errors: dict[str, str] = {}

    async def _send(self, http, rec, lane, p) -> bool:
        if time.perf_counter() >= self._deadline:
            return False
        salt = f"{self.cfg.salt}/{p}"
        payload = {"model": self.cfg.model, "prompt": self.filler.prompt(rec.hash_ids, rec.input_len, salt),
                   "max_tokens": rec.output_len, "ignore_eos": True, **self.cfg.sampling}
        entry = RequestRecord(rec, lane[0], p, False, 0, AgenticResult())
        self.requests.append(entry)
        key = id(entry)
        task = asyncio.ensure_future(stream_completion(http, self.cfg.url, payload, self.cfg.headers,
                                                       self.cfg.stall_timeout_s))
        if self.rng.random() < self.cancel_prob:
            await asyncio.wait({task}, timeout=self.rng.uniform(0.0, self.cancel_max_s))
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                self.outcomes[key] = "cancelled"
                return True
        try:
            entry.result = res = await task
        except asyncio.CancelledError:  # the run itself gave up on it: no outcome (lost)
            task.cancel()
            raise
        if res.success:
            self.outcomes[key] = "finished"
        else:
            self.categories[res.category] += 1
            self.first_errors.setdefault(res.category, res.error[:300])
            self.outcomes[key] = "errored" if res.category in ERRORED else "lost"
        return True


# -- server state ---------------------------------------------------------------------------------------------


async def scrape(http: aiohttp.ClientSession, base: str, headers: dict) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(f"{base}/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as r:
        text = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.keys() <= {"model_name"}:  # the gauges and totals, not per-label series
                out[s.name.removeprefix("openinfer:")] = s.value
    return out


def blocks_in_use(m: dict[str, float]) -> int:
    return int(m["kv_cache_total_blocks"] - m["kv_cache_free_blocks"])


async def sample_loop(http, base, headers, t0: float, interval_s: float, samples: list, stop: asyncio.Event):
    while not stop.is_set():
        with contextlib.suppress(Exception):
            m = await scrape(http, base, headers)
            samples.append({
                "t_s": round(time.perf_counter() - t0, 2),
                "rss_bytes": int(m.get("process_resident_memory_bytes", 0)),
                "kv_blocks_in_use": blocks_in_use(m),
                "running": int(m.get("num_requests_running", 0)),
                "waiting": int(m.get("num_requests_waiting", 0)),
                "open_fds": int(m.get("process_open_fds", 0)),
            })
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


async def wait_idle(http, base, headers, timeout_s: float) -> tuple[bool, dict[str, float]]:
    """Poll until nothing runs or waits and every KV block is back in the pool, up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = await scrape(http, base, headers)
        idle = m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0
        if (idle and blocks_in_use(m) == 0) or time.monotonic() > deadline:
            return idle, m
        await asyncio.sleep(0.25)


async def status_of(http, url: str, headers: dict) -> int | None:
    try:
        async with http.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as r:
            return r.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


# -- the run --------------------------------------------------------------------------------------------------


async def soak(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    base = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        async with http.get(f"{base}/v1/models", headers=headers) as r:
            card = (await r.json())["data"][0]
        model, max_model_len = args.model or card["id"], int(card.get("max_model_len") or 2048)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        records = synthesize(SynthConfig(
            sessions=args.sessions, turns=args.turns, block_size=args.block_size, system_blocks=2,
            first_message=(32, 192), turn_message=(16, 96), output=(8, args.max_output),
            think_ms_median=0.0, max_context=min(max_model_len, args.max_context), seed=args.seed))
        filler = Filler.for_tokenizer(tokenizer, args.block_size, f"soak-{args.seed}-{time.time_ns()}")
        cfg = RunConfig(url=base + "/v1/completions", model=model, concurrency=args.concurrency, warmup_turns=0,
                        duration_s=args.duration, stall_timeout_s=args.stall_timeout, salt=filler.salt,
                        headers=headers, sampling={"temperature": 1.0, "seed": args.seed},
                        honor_think_time=False)
        runner = SoakRunner(records, filler, cfg, cancel_prob=args.cancel_prob, cancel_max_s=args.cancel_max_s,
                            rng=rng)
        bodies = poison_bodies(model, args.max_body_bytes)
        poison: dict[str, Counter[str]] = {k: Counter() for k in bodies}

        async def poison_loop() -> None:
            end = time.perf_counter() + args.duration
            while time.perf_counter() < end:
                await asyncio.sleep(rng.expovariate(args.poison_rate))
                kind = rng.choice(list(bodies))
                poison[kind][await send_poison(http, cfg.url, bodies[kind], headers, args.stall_timeout)] += 1

        samples: list[dict] = []
        stop = asyncio.Event()
        t0 = time.perf_counter()
        sampler = asyncio.ensure_future(sample_loop(http, base, headers, t0, args.sample_interval, samples, stop))
        poisoner = asyncio.ensure_future(poison_loop()) if args.poison_rate > 0 else None
        replay = asyncio.ensure_future(runner.run(http))
        # Requests started before the deadline may run on; past the stall timeout the run gives up on them.
        done, _ = await asyncio.wait({replay}, timeout=args.duration + args.stall_timeout + 30)
        if not done:
            replay.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replay
        if poisoner is not None:
            await poisoner
        elapsed = time.perf_counter() - t0
        idle, final = await wait_idle(http, base, headers, args.idle_timeout)
        stop.set()
        await sampler
        samples.append({"t_s": round(time.perf_counter() - t0, 2),
                        "rss_bytes": int(final.get("process_resident_memory_bytes", 0)),
                        "kv_blocks_in_use": blocks_in_use(final), "running": int(final["num_requests_running"]),
                        "waiting": int(final["num_requests_waiting"]),
                        "open_fds": int(final.get("process_open_fds", 0))})
        health = await status_of(http, base + "/health", headers)
        ready = await status_of(http, base + "/health/ready", headers)

    outcome = Counter(runner.outcomes.get(id(e), "lost") for e in runner.requests)
    poison_by_status = Counter()
    for c in poison.values():
        poison_by_status.update(c)
    poison_bad = {s: n for s, n in poison_by_status.items() if not s.startswith(("4", "closed:"))}
    rss = [s["rss_bytes"] for s in samples if s["rss_bytes"]]
    mib = 1 / 2**20
    report = {
        "command": " ".join(sys.argv),
        "url": base,
        "model": model,
        "duration_s": args.duration,
        "elapsed_s": round(elapsed, 1),
        "concurrency": args.concurrency,
        "cancel_prob": args.cancel_prob,
        "poison_rate_per_s": args.poison_rate,
        "requests": {"sent": len(runner.requests), "finished": outcome["finished"], "errored": outcome["errored"],
                     "cancelled": outcome["cancelled"], "lost": outcome["lost"]},
        "failure_categories": dict(runner.categories),
        "first_error_by_category": runner.first_errors,
        "output_tokens": sum(e.result.output_tokens for e in runner.requests),
        "poison": {"sent": sum(poison_by_status.values()), "by_status": dict(poison_by_status),
                   "not_4xx": poison_bad, "by_kind": {k: dict(v) for k, v in poison.items() if v}},
        "kv_blocks": {"total": int(final["kv_cache_total_blocks"]), "leaked": blocks_in_use(final),
                      "server_idle_at_end": idle},
        "rss_mib": {"start": round(rss[0] * mib, 1) if rss else None, "end": round(rss[-1] * mib, 1) if rss else None,
                    "max": round(max(rss) * mib, 1) if rss else None},
        "health_after": {"/health": health, "/health/ready": ready},
        "samples": samples,
    }
    report["ok"] = (outcome["lost"] == 0 and report["kv_blocks"]["leaked"] == 0 and not poison_bad
                    and idle and health == 200)
    return report


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] for s in report["samples"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t, [s["rss_bytes"] / 2**20 for s in report["samples"]], color="tab:blue")
    ax.set_xlabel("seconds")
    ax.set_ylabel("server RSS (MiB)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(t, [s["kv_blocks_in_use"] for s in report["samples"]], color="tab:orange", alpha=0.7)
    ax2.set_ylabel("KV blocks in use", color="tab:orange")
    r = report["requests"]
    ax.set_title(f"soak: {r['sent']} sent, {r['finished']} finished, {r['cancelled']} cancelled, {r['errored']} "
                 f"errored, {r['lost']} lost; {report['kv_blocks']['leaked']} blocks leaked", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--tokenizer", required=True, help="the served model's tokenizer folder (prompts are token ids)")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 180)")
    p.add_argument("--concurrency", type=int, default=32, help="live agentic sessions (default 32)")
    p.add_argument("--sessions", type=int, default=64, help="synthetic sessions in the trace (cycled)")
    p.add_argument("--turns", type=int, default=4, help="main-agent turns per session")
    p.add_argument("--block-size", type=int, default=16, help="trace block size (tokens per hash id)")
    p.add_argument("--max-output", type=int, default=48, help="answer tokens per turn at most")
    p.add_argument("--max-context", type=int, default=1024, help="cap on prompt + answer tokens")
    p.add_argument("--cancel-prob", type=float, default=0.15, help="share of requests the client cancels")
    p.add_argument("--cancel-max-s", type=float, default=2.0, help="a cancel comes within this many seconds")
    p.add_argument("--poison-rate", type=float, default=2.0, help="poison requests per second (0 = none)")
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="the server's --max-body-bytes")
    p.add_argument("--stall-timeout", type=float, default=60.0, help="seconds without a byte: the request is lost")
    p.add_argument("--idle-timeout", type=float, default=30.0, help="how long to wait for the server to go idle")
    p.add_argument("--sample-interval", type=float, default=2.0, help="seconds between /metrics samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON report here (default: stdout only)")
    p.add_argument("--plot", default=None, help="write a PNG of RSS and KV blocks over time (needs matplotlib)")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.concurrency < 1 or not 0 <= args.cancel_prob <= 1 or args.poison_rate < 0:
        p.error("--duration > 0, --concurrency >= 1, 0 <= --cancel-prob <= 1 and --poison-rate >= 0 are required")
    report = asyncio.run(soak(args))
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot(report, args.plot)
    summary = {k: report[k] for k in ("requests", "kv_blocks", "rss_mib", "health_after", "ok")}
    summary["poison"] = {k: report["poison"][k] for k in ("sent", "by_status", "not_4xx")}
    print(json.dumps(summary, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
