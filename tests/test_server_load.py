"""Concurrency and cancellation against a real server: 200 concurrent streams, /metrics equal to what the
clients saw, 50 of 100 streams cancelled mid-flight with the KV pool back to all-free within a second, and
non-streaming clients that hang up."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from server_utils import ServerProcess, shared_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # a load test; asserts the blocks are freed within 1 s

ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--num-kv-blocks",
    "2048",
    "--max-num-seqs",
    "256",
    "--served-model-name",
    "tiny",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = shared_checkpoint(tmp_path_factory)
    with ServerProcess(ckpt, *ARGS) as s:
        yield s


def _delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def _wait_all_free(server, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        idle = m["openinfer:num_requests_running"] == 0 and m["openinfer:num_requests_waiting"] == 0
        if idle and m["openinfer:kv_cache_free_blocks"] == m["openinfer:kv_cache_total_blocks"]:
            assert m["openinfer:kv_cache_usage_perc"] == 0
            return m
        assert time.monotonic() < deadline, f"KV pool not all free after {timeout_s}s: {m}"
        time.sleep(0.02)


async def _stream(client, i: int, max_tokens: int, chat: bool, cancel_after: int | None = None):
    extra = {"ignore_eos": True, "return_token_ids": True}
    if chat:
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    else:
        stream = await client.completions.create(
            model="tiny",
            prompt=f"request {i}",
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    n, usage, finish = 0, None, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            n += len(c.model_extra["token_ids"])
            finish = c.finish_reason or finish
        if cancel_after is not None and n >= cancel_after:
            await stream.close()
            return "cancelled", n, None, None
    return "done", n, usage, finish


def test_200_concurrent_streams_and_metrics(server):
    before = server.metrics()

    async def main():
        client = server.async_client(timeout=120)
        return await asyncio.gather(*(_stream(client, i, 16, chat=i % 2 == 0) for i in range(200)))

    results = asyncio.run(main())
    assert [r[0] for r in results] == ["done"] * 200
    assert all(
        n == 16 and usage.completion_tokens == 16 and finish == "length" for _, n, usage, finish in results
    )
    after = _wait_all_free(server, 2.0)
    assert _delta(before, after, "openinfer:prompt_tokens_total") == sum(r[2].prompt_tokens for r in results)
    assert _delta(before, after, "openinfer:generation_tokens_total") == 200 * 16
    assert _delta(before, after, 'openinfer:request_success_total{finished_reason="length"}') == 200
    assert _delta(before, after, "openinfer:e2e_request_latency_seconds_count") == 200
    assert _delta(before, after, "openinfer:time_to_first_token_seconds_count") == 200
    assert _delta(before, after, "openinfer:request_generation_tokens_sum") == 200 * 16
    assert _delta(before, after, "openinfer:inter_token_latency_seconds_count") == 200 * 15
    assert _delta(before, after, "openinfer:prefix_cache_queries_total") >= sum(
        r[2].prompt_tokens for r in results
    )


def test_cancel_half_of_100_mid_stream(server):
    before = server.metrics()

    async def main():
        client = server.async_client(timeout=120)
        # Odd requests are cancelled after their first tokens; their max_tokens is large so they are surely
        # still running when the client goes away.
        return await asyncio.gather(
            *(
                _stream(client, i, 200 if i % 2 else 48, chat=i % 4 < 2, cancel_after=2 if i % 2 else None)
                for i in range(100)
            )
        )

    results = asyncio.run(main())
    t_done = time.monotonic()
    kept = [r for r in results if r[0] == "done"]
    assert len(kept) == 50 and all(
        n == 48 and u.completion_tokens == 48 and f == "length" for _, n, u, f in kept
    )
    assert all(r[0] == "cancelled" and 2 <= r[1] < 200 for r in results[1::2])
    after = _wait_all_free(server, 1.0)
    assert time.monotonic() - t_done < 1.0
    assert _delta(before, after, 'openinfer:request_success_total{finished_reason="abort"}') == 50
    assert _delta(before, after, 'openinfer:request_success_total{finished_reason="length"}') == 50


def test_nonstreaming_disconnect_aborts(server):
    before = server.metrics()

    async def one(i: int) -> bool:
        async with httpx.AsyncClient(timeout=httpx.Timeout(0.25)) as c:
            try:
                await c.post(
                    server.url + "/v1/completions",
                    json={"model": "tiny", "prompt": f"hang up {i}", "max_tokens": 240, "ignore_eos": True},
                )
                return False
            except httpx.ReadTimeout:
                return True

    async def main():
        return await asyncio.gather(*(one(i) for i in range(32)))

    hung_up = sum(asyncio.run(main()))
    assert hung_up > 0
    deadline = time.monotonic() + 2.0
    while (
        _delta(before, server.metrics(), 'openinfer:request_success_total{finished_reason="abort"}') < hung_up
    ):
        assert time.monotonic() < deadline, "disconnected non-streaming requests were not aborted"
        time.sleep(0.02)
    after = _wait_all_free(server, 1.0)
    assert _delta(before, after, 'openinfer:request_success_total{finished_reason="abort"}') == hung_up
