"""``openinfer bench serve --workload agentic``: flags and the run (trace or synthetic -> replay -> report).

Shares the target, sampling and output flags of ``bench serve``; adds the trace source, live-session
concurrency, duration, device count and validity knobs below. ``--write-trace FILE`` only writes the
synthetic trace and exits (no server needed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from openinfer.bench.agentic.filler import Filler
from openinfer.bench.agentic.report import build_report, format_summary
from openinfer.bench.agentic.runner import AgenticRunner, RunConfig, scrape_prefix_cache
from openinfer.bench.agentic.synth import SynthConfig, synthesize
from openinfer.bench.agentic.trace import TraceRecord, load_trace, write_trace
from openinfer.bench.serve_report import add_metadata, save_result


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("agentic workload (--workload agentic)")
    g.add_argument("--trace", default=None, help="JSONL trace of {session_id, turn, in, out, hash_ids, ...}")
    g.add_argument("--trace-block-size", type=int, default=64, help="tokens per hash id (AgentX: 64)")
    g.add_argument("--synthetic-sessions", type=int, default=8, help="without --trace: sessions to generate")
    g.add_argument("--synthetic-turns", type=int, default=4, help="main-agent turns per synthetic session")
    g.add_argument("--synthetic-system-blocks", type=int, default=2, help="shared system-prompt blocks")
    g.add_argument("--synthetic-first-len", default="64:256", help="first user message tokens, LO:HI")
    g.add_argument("--synthetic-turn-len", default="32:192", help="new message tokens per turn, LO:HI")
    g.add_argument("--synthetic-output-len", default="16:64", help="answer tokens per turn, LO:HI")
    g.add_argument("--synthetic-think-ms", type=float, default=500.0, help="median think time")
    g.add_argument("--synthetic-subagent-prob", type=float, default=0.3)
    g.add_argument("--synthetic-subagent-fanout", type=int, default=2)
    g.add_argument("--synthetic-subagent-turns", type=int, default=2)
    g.add_argument(
        "--synthetic-max-context",
        type=int,
        default=None,
        help="cap on prompt + answer (default: the server's max_model_len, else 32768)",
    )
    g.add_argument("--write-trace", default=None, help="write the synthetic trace to FILE and exit")
    g.add_argument(
        "--concurrency", type=int, default=None, help="live sessions (default: --max-concurrency, else 4)"
    )
    g.add_argument("--duration", type=float, default=None, help="seconds; cycle the trace until then")
    g.add_argument("--num-devices", type=int, default=1, help="accelerators serving (for per-device tok/s)")
    g.add_argument(
        "--agentic-warmup-turns", type=int, default=1, help="first requests per lane kept out of metrics"
    )
    g.add_argument("--stall-timeout", type=float, default=300.0, help="seconds without a byte = stalled")
    g.add_argument("--no-think-time", action="store_true", help="send each turn as soon as it may start")
    g.add_argument("--salt", default=None, help="filler salt (default: random per run, so runs never share)")


def _range(text: str, flag: str) -> tuple[int, int]:
    try:
        parts = [int(x) for x in text.split(":")]
    except ValueError:
        raise ValueError(f"{flag} expects LO:HI or N (integers), got {text!r}") from None
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2:
        raise ValueError(f"{flag} expects LO:HI or N, got {text!r}")
    return parts[0], parts[1]


def synth_config(args: argparse.Namespace, max_context: int | None) -> SynthConfig:
    return SynthConfig(
        sessions=args.synthetic_sessions,
        turns=args.synthetic_turns,
        block_size=args.trace_block_size,
        system_blocks=args.synthetic_system_blocks,
        first_message=_range(args.synthetic_first_len, "--synthetic-first-len"),
        turn_message=_range(args.synthetic_turn_len, "--synthetic-turn-len"),
        output=_range(args.synthetic_output_len, "--synthetic-output-len"),
        think_ms_median=args.synthetic_think_ms,
        subagent_prob=args.synthetic_subagent_prob,
        subagent_fanout=args.synthetic_subagent_fanout,
        subagent_turns=args.synthetic_subagent_turns,
        max_context=args.synthetic_max_context or max_context or 32768,
        seed=args.seed,
    )


def trace_for(args: argparse.Namespace, max_context: int | None) -> list[TraceRecord]:
    if args.trace:
        return load_trace(args.trace, args.trace_block_size)
    return synthesize(synth_config(args, max_context))


async def _max_model_len(http: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> int | None:
    try:
        async with http.get(f"{base}/v1/models", headers=headers, timeout=aiohttp.ClientTimeout(30)) as r:
            data = (await r.json(content_type=None)).get("data") or [{}]
            value = data[0].get("max_model_len")
            return int(value) if value else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
        return None


def main(args: argparse.Namespace) -> int:
    if args.write_trace:
        records = trace_for(args, None)
        write_trace(records, args.write_trace)
        sessions = len({r.session_id for r in records})
        print(f"Wrote {len(records)} requests in {sessions} sessions to {args.write_trace}")
        return 0
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    from openinfer.bench.serve import _CONTROL_TIMEOUT, _discover_model, load_tokenizer_for
    from openinfer.bench.serve_client import open_session

    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or "/v1/completions"
    if args.backend == "openai-chat" or endpoint.rstrip("/").endswith("chat/completions"):
        raise ValueError(
            "--workload agentic sends exact token-id prompts, so it needs the completions endpoint "
            "(not --backend openai-chat or a chat endpoint)"
        )
    concurrency = args.concurrency or args.max_concurrency or 4
    sampling: dict[str, Any] = {"temperature": 0.0 if args.temperature is None else args.temperature}
    for key in ("top_p", "top_k", "min_p"):
        if getattr(args, key) is not None:
            sampling[key] = getattr(args, key)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    salt = args.salt if args.salt is not None else secrets.token_hex(8)
    # A trace file is checked before waiting on the server: a bad file is the client's mistake and should fail
    # at once; a synthetic trace needs the server's max_model_len first.
    records = load_trace(args.trace, args.trace_block_size) if args.trace else None
    async with open_session() as http:
        server_model, root = await _discover_model(http, base, headers, args.ready_check_timeout_sec)
        model_id = args.served_model_name or args.model or server_model
        if not model_id:
            raise ValueError("cannot tell which model to request: pass --model")
        max_context = await _max_model_len(http, base, headers)
        if records is None:
            records = trace_for(args, max_context)
        tokenizer, tokenizer_id = load_tokenizer_for(args, root)
        filler = Filler.for_tokenizer(tokenizer, args.trace_block_size, salt)
        cfg = RunConfig(
            url=base + endpoint,
            model=model_id,
            concurrency=concurrency,
            warmup_turns=args.agentic_warmup_turns,
            duration_s=args.duration,
            stall_timeout_s=args.stall_timeout,
            salt=salt,
            headers=headers,
            sampling=sampling,
            extra_body=json.loads(args.extra_body) if args.extra_body else {},
            honor_think_time=not args.no_think_time,
        )
        runner = AgenticRunner(records, filler, cfg)
        if args.reset_prefix_cache:
            reset = f"{base}/reset_prefix_cache"
            async with http.post(reset, headers=headers, timeout=_CONTROL_TIMEOUT) as r:
                print(f"Reset prefix cache: HTTP {r.status}")
        sessions = len(runner.sessions)
        print(f"Agentic replay: {len(records)} requests in {sessions} sessions, {concurrency} live sessions")
        before = await scrape_prefix_cache(http, base, headers)
        requests = await runner.run(http)
        after = await scrape_prefix_cache(http, base, headers)
    header = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "workload": "agentic",
        "backend": args.backend,
        "label": args.label or args.backend,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "endpoint": endpoint,
        "concurrency": concurrency,
        "trace": args.trace or "synthetic",
        "trace_block_size": args.trace_block_size,
        "salt": salt,
    }
    if not args.trace:
        header["synthetic"] = vars(synth_config(args, max_context))
    add_metadata(header, args.metadata)
    report = build_report(requests, args.num_devices, before, after, header, args.save_detailed)
    failed = [q for q in requests if not q.result.success]
    if failed:
        print(f"===== {len(failed)} failed; first error: {failed[0].result.error} =====")
    print(format_summary(report))
    if args.save_result:
        model_name = Path(str(model_id)).name
        name = args.result_filename or (
            f"{header['label']}-agentic-concurrency{concurrency}-{model_name}-{header['date']}.json"
        )
        save_result(report, args.result_dir, name)
    return 0 if report["completed"] > 0 else 1
