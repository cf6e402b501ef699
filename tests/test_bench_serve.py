"""``openinfer bench serve``: vLLM's metric definitions, result block and JSON names, the random dataset and
arrival process, and an end-to-end run against a live (in-process) openinfer server."""

from __future__ import annotations

import asyncio
import json
import socket

import numpy as np
import pytest
from server_utils import InProcessServer, shared_checkpoint

from openinfer.bench.metrics import p_word, parse_percentiles, summarize_ms
from openinfer.bench.serve import arrival_delays, sample_random_requests
from openinfer.bench.serve_client import RequestInput, RequestResult, open_session, send_request
from openinfer.bench.serve_report import compute_metrics, format_block, result_json
from openinfer.entrypoints.cli import build_parser

METRICS = ["ttft", "tpot", "itl", "e2el"]


def _results() -> list[RequestResult]:
    a = RequestResult(True, "abcd", 4, 10, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2, start_time=100.0)
    b = RequestResult(True, "xy", 2, 20, ttft=0.3, itl=[0.1], latency=0.4, start_time=100.5)
    c = RequestResult(False, "", 0, 30, error="HTTP 400: nope", start_time=100.2)
    return [a, b, c]


def test_metric_definitions_match_vllm():
    m = compute_metrics(_results(), duration_s=2.0, percentiles=[90, 99])
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (
        m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    )  # failed requests count for nothing
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0) and m["total_token_throughput"] == pytest.approx(18.0)
    # TPOT excludes the first token: (E2EL - TTFT) / (output - 1), per request.
    tpots = [(0.2 - 0.1) / 3, (0.4 - 0.3) / 1]
    assert m["mean_tpot_ms"] == pytest.approx(np.mean(tpots) * 1000)
    # ITL pools every gap of every request; percentiles interpolate linearly.
    itls = [0.02, 0.03, 0.05, 0.1]
    assert m["mean_itl_ms"] == pytest.approx(np.mean(itls) * 1000)
    assert m["p90_itl_ms"] == pytest.approx(np.percentile(itls, 90) * 1000)
    assert m["median_ttft_ms"] == pytest.approx(200.0) and m["p99_e2el_ms"] == pytest.approx(
        np.percentile([0.2, 0.4], 99) * 1000
    )
    assert m["max_output_tokens_per_s"] == 6 and m["max_concurrent_requests"] == 2
    assert m["output_lens"] == [4, 2, 0]


def test_goodput_and_token_fallback():
    m = compute_metrics(_results(), 1.0, [99], goodput_ms={"ttft": 150.0})
    assert m["request_goodput"] == pytest.approx(1.0)
    r = RequestResult(True, "hello", 0, 3, ttft=0.1, itl=[0.1], latency=0.3, start_time=0.0)
    m = compute_metrics([r], 1.0, [99], count_tokens=len)  # no server usage: re-tokenize the text
    assert m["total_output_tokens"] == 5


def test_block_and_json_use_vllm_names():
    m = compute_metrics(_results(), 2.0, [90, 99])
    block = format_block(m, 2.0, 4, float("inf"), METRICS, [90, 99], goodput=False)
    lines = block.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============" and lines[-1] == "=" * 50
    for label in (
        "Successful requests:",
        "Failed requests:",
        "Maximum request concurrency:",
        "Benchmark duration (s):",
        "Total input tokens:",
        "Total generated tokens:",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Total Token throughput (tok/s):",
        "Mean TTFT (ms):",
        "Median TTFT (ms):",
        "P90 TTFT (ms):",
        "P99 TTFT (ms):",
        "Mean TPOT (ms):",
        "P99 ITL (ms):",
        "Median E2EL (ms):",
    ):
        assert any(line.startswith(label) for line in lines), label
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "{:<40} {:<10}".format("Successful requests:", 2) in lines
    out = result_json(m, _results(), METRICS, [90, 99], detailed=True, header={"date": "x"}, duration_s=2.0)
    for key in (
        "duration",
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
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p90_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "latencies",
        "start_times",
        "generated_texts",
        "errors",
    ):
        assert key in out, key
    assert "ttfts" not in result_json(m, _results(), METRICS, [90], False, {}, 2.0)
    assert p_word(99.9) == "99.9" and p_word(90.0) == "90"
    assert parse_percentiles("90, 99,99.9") == [90, 99, 99.9]
    assert summarize_ms([], [99]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def test_random_dataset_and_arrivals(tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(shared_checkpoint(tmp_path_factory)))
    reqs = sample_random_requests(tok, 50, 40, 10, 0.5, 8, seed=3)
    assert all(20 + 8 <= n_in <= 60 + 8 and 5 <= n_out <= 15 for _, _, n_in, n_out in reqs)
    assert all(len(tok.encode(text)) == n_in for text, _, n_in, _ in reqs)
    assert len({text[:8] for text, *_ in reqs}) == 1  # the shared random prefix
    assert reqs == sample_random_requests(tok, 50, 40, 10, 0.5, 8, seed=3)
    assert arrival_delays(5, float("inf"), 1.0, np.random.default_rng(0)) == [0.0] * 5
    d = arrival_delays(1000, 20.0, 1.0, np.random.default_rng(0))
    assert d[-1] == pytest.approx(1000 / 20.0) and all(x <= y for x, y in zip(d, d[1:]))
    with pytest.raises(ValueError):
        sample_random_requests(tok, 1, 10, 10, 1.0, 0, 0)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with InProcessServer(
        shared_checkpoint(tmp_path_factory), dtype="float32", max_model_len=256, num_kv_blocks=512
    ) as srv:
        yield srv


def _bench(argv: list[str]) -> int:
    args = build_parser().parse_args(["bench", "serve", *argv])
    return args.func(args)


def test_bench_serve_end_to_end(live, tmp_path, capsys):
    rc = _bench(
        [
            "--base-url",
            live.url,
            "--num-prompts",
            "12",
            "--max-concurrency",
            "4",
            "--random-input-len",
            "32",
            "--random-output-len",
            "8",
            "--ignore-eos",
            "--num-warmups",
            "2",
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "r.json",
            "--disable-tqdm",
            "--metadata",
            "run=ci",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "============ Serving Benchmark Result ============" in out and "P99 TPOT (ms):" in out
    res = json.loads((tmp_path / "r.json").read_text())
    assert (res["completed"], res["failed"], res["num_prompts"], res["max_concurrency"]) == (12, 0, 12, 4)
    assert res["total_output_tokens"] == 12 * 8 and res["output_lens"] == [8] * 12
    assert res["total_input_tokens"] == sum(res["input_lens"]) == 12 * 32
    assert res["request_rate"] == "inf" and res["model_id"] == "tiny" and res["run"] == "ci"
    assert all(len(itl) == 7 for itl in res["itls"]) and res["mean_ttft_ms"] > 0 and res["p90_e2el_ms"] > 0
    assert 1 <= res["max_concurrent_requests"] <= 12  # vLLM counts per 1-second bucket, not instantaneous
    # chat endpoint with a finite (Poisson) request rate
    rc = _bench(
        [
            "--base-url",
            live.url,
            "--backend",
            "openai-chat",
            "--num-prompts",
            "6",
            "--request-rate",
            "50",
            "--random-input-len",
            "16",
            "--random-output-len",
            "4",
            "--ignore-eos",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "c.json",
        ]
    )
    assert rc == 0
    res = json.loads((tmp_path / "c.json").read_text())
    assert res["completed"] == 6 and res["total_output_tokens"] == 24 and res["request_rate"] == 50.0


def test_bench_serve_counts_failures(live, tmp_path, capsys):
    # Prompts longer than the server's context: every request fails with a 400 and is counted, not hidden.
    rc = _bench(
        [
            "--base-url",
            live.url,
            "--num-prompts",
            "3",
            "--random-input-len",
            "300",
            "--random-output-len",
            "4",
            "--ready-check-timeout-sec",
            "0",
            "--disable-tqdm",
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "f.json",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 1 and "maximum context length" in out
    res = json.loads((tmp_path / "f.json").read_text())
    assert (res["completed"], res["failed"]) == (0, 3) and all("HTTP 400" in e for e in res["errors"])


def test_send_request_records_transport_errors():
    """Refused connections, malformed SSE and a stream cut mid-body end up in the request's ``error``;
    nothing is raised out of the run, and the session keeps working for the next request."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        await reader.readexactly(int(length.split(b":")[1]))
        sse = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
        if b"/garbage" in head:
            body = b"data: {not json\n\n"
            writer.write(sse + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        elif b"/cut" in head:  # promises 1000 bytes, sends one event, hangs up
            writer.write(sse + b'Content-Length: 1000\r\n\r\ndata: {"choices": [{"text": "a"}]}\n\n')
        else:
            body = b"".join(b"data: %s\n\n" % d for d in (b'{"choices": [{"text": "a"}]}', b"[DONE]"))
            body = b'data: {"choices": [{"text": ""}]}\n\n' + body
            writer.write(sse + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        writer.close()

    def req(url: str) -> RequestInput:
        return RequestInput("hi", 1, 2, "m", url)

    async def go() -> list[RequestResult]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1/completions"
        async with server, open_session(2) as session:
            return [
                await send_request(session, req(u))
                for u in (dead, base + "/garbage", base + "/cut", base + "/ok")
            ]

    refused, garbage, cut, ok = asyncio.run(go())
    for r in (refused, garbage, cut):
        assert not r.success and r.error, r
    assert "Connect" in refused.error and "DecodeError" in garbage.error
    assert cut.ttft > 0  # the first event arrived before the cut
    assert ok.success and ok.generated_text == "a" and ok.ttft > 0 and len(ok.itl) == 1
