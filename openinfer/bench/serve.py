"""``openinfer bench serve``: a load generator for any OpenAI-compatible server (openinfer, vLLM, SGLang).

Same flags, metric definitions, printed block and JSON field names as ``vllm bench serve`` (random dataset):
TTFT, TPOT = (E2EL - TTFT) / (output_tokens - 1) per request (excludes the first token), ITL = gaps between
streamed chunks pooled over requests, E2EL = send -> last chunk. ``--random-range-ratio r`` samples lengths
uniformly in [L*(1-r), L*(1+r)] as current vLLM does (InferenceX's older fork used [L*r, L]).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from openinfer.bench.metrics import parse_percentiles
from openinfer.bench.serve_client import RequestInput, RequestResult, open_session, send_request
from openinfer.bench.serve_report import (
    METRIC_NAMES,
    add_metadata,
    compute_metrics,
    format_block,
    result_json,
    save_result,
)


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--endpoint", default=None, help="default /v1/completions (/v1/chat/completions for openai-chat)"
    )
    g.add_argument(
        "--backend",
        default="openai",
        choices=["openai", "openai-chat", "vllm", "sglang", "openinfer"],
        help="openai (completions) or openai-chat; vllm/sglang/openinfer are aliases of openai",
    )
    g.add_argument(
        "--model", default=None, help="model id sent in requests (default: the server's first model)"
    )
    g.add_argument("--served-model-name", default=None, help="override the model id sent in requests")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer folder used to build prompts (default: --model "
        "if it is a local folder, else the server's model root when it is a local folder)",
    )
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    d = p.add_argument_group("dataset")
    d.add_argument(
        "--workload",
        default="random",
        choices=["random", "agentic"],
        help="random: independent requests (vLLM's random dataset); agentic: multi-turn agent sessions "
        "replayed from a trace (see the agentic group)",
    )
    d.add_argument("--dataset-name", default="random", choices=["random"])
    d.add_argument("--num-prompts", type=int, default=1000)
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--random-prefix-len", type=int, default=0)
    d.add_argument(
        "--prompt-format",
        choices=["text", "token-ids"],
        default="text",
        help="token-ids sends exact id lists (completions endpoint only)",
    )
    d.add_argument("--seed", type=int, default=0)
    lo = p.add_argument_group("load")
    lo.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf = all at once)")
    lo.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    lo.add_argument("--max-concurrency", type=int, default=None)
    lo.add_argument("--num-warmups", type=int, default=0)
    lo.add_argument("--ignore-eos", action="store_true")
    lo.add_argument("--temperature", type=float, default=None, help="default: greedy (0.0), as vLLM")
    lo.add_argument("--top-p", type=float, default=None)
    lo.add_argument("--top-k", type=int, default=None)
    lo.add_argument("--min-p", type=float, default=None)
    lo.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    lo.add_argument("--ready-check-timeout-sec", type=float, default=60.0)
    lo.add_argument(
        "--reset-prefix-cache", action="store_true", help="POST /reset_prefix_cache before the run"
    )
    o = p.add_argument_group("output")
    o.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    o.add_argument("--metric-percentiles", default="90,99")
    o.add_argument("--goodput", nargs="+", default=None, help="SLOs as KEY:ms, e.g. ttft:500 tpot:50")
    o.add_argument("--save-result", action="store_true")
    o.add_argument("--save-detailed", action="store_true", help="also save per-request lists")
    o.add_argument("--result-dir", default=".")
    o.add_argument("--result-filename", default=None)
    o.add_argument("--metadata", nargs="*", default=None, help="KEY=VALUE pairs stored in the JSON")
    o.add_argument("--label", default=None)
    o.add_argument("--disable-tqdm", action="store_true")
    from openinfer.bench.agentic import cli as agentic_cli  # here: agentic.cli imports this module

    agentic_cli.add_args(p)


# -- dataset ---------------------------------------------------------------------------------------


def _lens(rng: np.random.Generator, n: int, length: int, ratio: float, minimum: int) -> np.ndarray:
    low = max(int(np.floor(length * (1 - ratio))), minimum)
    high = max(int(np.ceil(length * (1 + ratio))), low)
    return rng.integers(low, high + 1, size=n)


def sample_random_requests(
    tokenizer, num: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int, seed: int
) -> list[tuple[str, list[int], int, int]]:
    """``(text, ids, prompt_len, output_len)`` per request. Random non-special token ids are decoded to text
    and re-encoded; the text is trimmed until it re-encodes to the drawn length (close to it for BPE edge
    cases)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    rng = np.random.default_rng(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    allowed = np.array([i for i in range(len(tokenizer)) if i not in special])
    # The server adds the tokenizer's special tokens (BOS) back, so draw the rest: prompts then total
    # --random-input-len tokens as the server counts them, as in vLLM.
    num_special = (
        int(tokenizer.num_special_tokens_to_add()) if hasattr(tokenizer, "num_special_tokens_to_add") else 0
    )
    in_lens = _lens(rng, num, max(input_len - num_special, 1), range_ratio, 1)
    out_lens = _lens(rng, num, output_len, range_ratio, 1)
    prefix = rng.choice(allowed, size=prefix_len).tolist() if prefix_len else []
    out = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        ids = prefix + rng.choice(allowed, size=n_in).tolist()
        target = prefix_len + n_in
        text = tokenizer.decode(ids)
        for _ in range(10):
            enc = tokenizer.encode(text, add_special_tokens=False)
            if len(enc) == target:
                ids = enc
                break
            if len(enc) > target:
                enc = enc[:target]
            else:
                enc = enc + rng.choice(allowed, size=target - len(enc)).tolist()
            ids, text = enc, tokenizer.decode(enc)
        prompt_len = len(tokenizer.encode(text))
        out.append((text, ids, prompt_len, n_out))
    return out


def load_tokenizer_for(args: argparse.Namespace, model_root: str | None):
    from transformers import AutoTokenizer

    for cand in (args.tokenizer, args.model, model_root):
        if cand and Path(cand).is_dir():
            return AutoTokenizer.from_pretrained(cand), cand
    if args.tokenizer:
        return AutoTokenizer.from_pretrained(args.tokenizer), args.tokenizer
    raise ValueError(
        "cannot find a tokenizer to build prompts: pass --tokenizer PATH (an HF tokenizer folder)"
    )


# -- load ------------------------------------------------------------------------------------------


def arrival_delays(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Cumulative send offsets (s): 0 for an infinite rate, else gamma(shape=burstiness) gaps (Poisson at 1)
    rescaled so the last one lands at n / rate, as vLLM does to steady throughput across seeds."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    cum = np.cumsum(gaps)
    if cum[-1] > 0:
        cum *= (n / rate) / cum[-1]
    return cum.tolist()


async def run_requests(
    session: aiohttp.ClientSession,
    inputs: list[RequestInput],
    delays: list[float],
    max_concurrency: int | None,
    headers: dict[str, str],
    pbar=None,
) -> list[RequestResult]:
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(inp: RequestInput, delay: float) -> RequestResult:
        wait = start + delay - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        if sem is None:
            res = await send_request(session, inp, headers)
        else:
            async with sem:
                res = await send_request(session, inp, headers)
        if pbar is not None:
            pbar.update(1)
        return res

    return await asyncio.gather(*(one(i, d) for i, d in zip(inputs, delays)))


# -- main ------------------------------------------------------------------------------------------


def _parse_goodput(items: list[str] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput entries look like ttft:500 (keys ttft, tpot, e2el), got {item!r}")
        out[key] = float(value)
    return out


_CONTROL_TIMEOUT = aiohttp.ClientTimeout(total=60, sock_connect=30)  # /v1/models, /reset_prefix_cache


async def _discover_model(
    session: aiohttp.ClientSession,
    base: str,
    headers: dict[str, str],
    timeout_s: float,
) -> tuple[str | None, str | None]:
    """The first served model id and its local folder (vLLM's ``root``; openinfer's ``/get_model_info``), waiting
    for the server."""
    deadline = time.monotonic() + max(timeout_s, 0.0)
    while True:
        try:
            async with session.get(f"{base}/v1/models", headers=headers, timeout=_CONTROL_TIMEOUT) as r:
                if r.status == 200:
                    data = (await r.json(content_type=None)).get("data") or []
                    if data:
                        return data[0].get("id"), await _local_root(session, base, headers, data[0].get("root"))
                    return None, None
                if r.status in (401, 403, 404):
                    return None, None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise ValueError(f"the server at {base} did not answer /v1/models within {timeout_s:.0f}s")
        await asyncio.sleep(0.5)


async def _local_root(session, base: str, headers: dict[str, str], root: str | None) -> str | None:
    """vLLM's /v1/models shows the checkpoint path as ``root``; openinfer shows only the model id there (a client
    has no business with the server's paths) and tells the tokenizer's folder on ``/get_model_info`` (the router
    endpoint, behind the API key) instead."""
    if root and Path(root).is_dir():
        return root
    try:
        async with session.get(f"{base}/get_model_info", headers=headers, timeout=_CONTROL_TIMEOUT) as r:
            if r.status == 200:
                info = await r.json(content_type=None)
                return info.get("tokenizer_path") or info.get("model_path") or root
    except (aiohttp.ClientError, TimeoutError, ValueError):
        pass
    return root


def main(args: argparse.Namespace) -> int:
    if args.workload == "agentic":
        from openinfer.bench.agentic import cli as agentic_cli

        return agentic_cli.main(args)
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    chat = args.backend == "openai-chat"
    endpoint = args.endpoint or ("/v1/chat/completions" if chat else "/v1/completions")
    chat = chat or endpoint.rstrip("/").endswith("chat/completions")
    if chat and args.prompt_format == "token-ids":
        raise ValueError("--prompt-format token-ids needs the completions endpoint")
    metrics = [k.strip() for k in args.percentile_metrics.split(",") if k.strip()]
    unknown = [k for k in metrics if k not in METRIC_NAMES]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; choose from {list(METRIC_NAMES)}")
    percentiles = parse_percentiles(args.metric_percentiles)
    goodput = _parse_goodput(args.goodput)
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    extra_body = json.loads(args.extra_body) if args.extra_body else {}
    sampling: dict[str, Any] = {"temperature": 0.0 if args.temperature is None else args.temperature}
    for key in ("top_p", "top_k", "min_p"):
        if getattr(args, key) is not None:
            sampling[key] = getattr(args, key)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # One aiohttp session (connection pool) for the whole run: control calls and measured requests.
    async with open_session(args.max_concurrency) as session:
        server_model, root = await _discover_model(session, base, headers, args.ready_check_timeout_sec)
        model_id = args.served_model_name or args.model or server_model
        if not model_id:
            raise ValueError("cannot tell which model to request: pass --model")
        tokenizer, tokenizer_id = load_tokenizer_for(args, root)
        samples = sample_random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            args.seed,
        )
        url = base + endpoint
        inputs = [
            RequestInput(
                ids if args.prompt_format == "token-ids" else text,
                n_in,
                n_out,
                model_id,
                url,
                chat,
                args.ignore_eos,
                sampling,
                extra_body,
            )
            for text, ids, n_in, n_out in samples
        ]
        if args.ready_check_timeout_sec > 0:
            print("Starting initial single prompt test run...")
            test = await send_request(session, inputs[0], headers)
            if not test.success:
                print(f"Initial test run failed: {test.error}")
                return 1
            print("Initial test run completed.")
        if args.num_warmups > 0:
            print(f"Warming up with {args.num_warmups} requests...")
            await run_requests(
                session,
                [inputs[0]] * args.num_warmups,
                [0.0] * args.num_warmups,
                args.max_concurrency,
                headers,
            )
            print("Warmup run completed.")
        if args.reset_prefix_cache:
            async with session.post(
                f"{base}/reset_prefix_cache", headers=headers, timeout=_CONTROL_TIMEOUT
            ) as r:
                print(f"Reset prefix cache: HTTP {r.status}")
        print("Starting main benchmark run...")
        print(f"Traffic request rate: {args.request_rate}")
        dist = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
        print(f"Burstiness factor: {args.burstiness} ({dist})")
        print(f"Maximum request concurrency: {args.max_concurrency}")
        delays = arrival_delays(
            len(inputs), args.request_rate, args.burstiness, np.random.default_rng(args.seed)
        )
        pbar = None
        if not args.disable_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(inputs))
        t0 = time.perf_counter()
        results = await run_requests(session, inputs, delays, args.max_concurrency, headers, pbar)
        duration = time.perf_counter() - t0
        if pbar is not None:
            pbar.close()
    failed = [r for r in results if not r.success]
    if failed:
        print(f"===== {len(failed)} failed; first error: {failed[0].error} =====")
    m = compute_metrics(
        results, duration, percentiles, goodput, lambda t: len(tokenizer.encode(t, add_special_tokens=False))
    )
    print(
        format_block(
            m, duration, args.max_concurrency, args.request_rate, metrics, percentiles, bool(goodput)
        )
    )
    if args.save_result:
        date = datetime.now().strftime("%Y%m%d-%H%M%S")
        label = args.label or args.backend
        header = {
            "date": date,
            "backend": args.backend,
            "label": label,
            "model_id": model_id,
            "tokenizer_id": tokenizer_id,
            "num_prompts": args.num_prompts,
            "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "endpoint": endpoint,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio,
        }
        add_metadata(header, args.metadata)
        result = result_json(m, results, metrics, percentiles, args.save_detailed, header, duration)
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = args.result_filename or (
            f"{label}-{args.request_rate}qps{conc}-{Path(str(model_id)).name}-{date}.json"
        )
        save_result(result, args.result_dir, name)
    return 0 if m["completed"] > 0 else 1
