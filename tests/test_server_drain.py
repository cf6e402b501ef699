"""SIGTERM drains: running streams finish (bounded by --drain-timeout-s), new requests get 503, /health/ready
fails, and the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from server_utils import InProcessServer, ServerProcess, shared_checkpoint

from openinfer.server.api import drain

pytestmark = pytest.mark.slow  # a server process, drained

ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--num-kv-blocks",
    "1024",
    "--served-model-name",
    "tiny",
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return shared_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(ckpt):
    with ServerProcess(ckpt, *ARGS, "--drain-timeout-s", "60") as s:
        yield s


class _Stream(threading.Thread):
    """One streaming completion read to the end in a thread; ``first`` is set at the first chunk."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.first = threading.Event()
        self.tokens, self.finish, self.done_marker, self.error = 0, None, False, None

    def run(self) -> None:
        body = {
            "model": "tiny",
            "prompt": "drain me",
            "max_tokens": self.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done_marker = True
                    elif line.startswith("data: "):
                        choice = json.loads(line[6:])["choices"][0]
                        self.tokens += len(choice["token_ids"])
                        self.finish = choice["finish_reason"] or self.finish
                        self.first.set()
        except Exception as e:  # surfaced by the assertions
            self.error = e
            self.first.set()


def _start_streams(server: ServerProcess, n: int, max_tokens: int) -> list[_Stream]:
    streams = [_Stream(server.url, max_tokens) for _ in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(60) and s.error is None, s.error
    return streams


def test_sigterm_lets_running_requests_finish(server):
    streams = _start_streams(server, 4, 400)
    server.signal(signal.SIGTERM)
    # While draining: new work is refused with 503, readiness fails, liveness holds.
    deadline = time.monotonic() + 5
    while True:
        r = httpx.post(
            server.url + "/v1/completions", json={"model": "tiny", "prompt": "late", "max_tokens": 2}
        )
        if r.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health/ready").status_code == 503
    assert httpx.get(server.url + "/health").status_code == 200
    for s in streams:
        s.join(60)
        assert s.error is None and s.tokens == 400 and s.finish == "length" and s.done_marker
    assert server.proc.wait(30) == 0


def test_drain_timeout_aborts_the_rest(ckpt):
    # In-process server: the drain itself with a short timeout (the SIGTERM wiring is covered above).
    with InProcessServer(ckpt, dtype="float32", max_model_len=1024, num_kv_blocks=1024) as srv:
        streams = _start_streams(srv, 4, 1000)
        t0 = time.monotonic()
        srv.run_coroutine(drain(srv.app, 0.3))
        assert time.monotonic() - t0 < 10
        for s in streams:
            s.join(30)
            assert s.error is None and s.done_marker
            assert s.finish == "abort" and 0 < s.tokens < 1000
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "late", "max_tokens": 2})
        assert r.status_code == 503
        assert srv.engine.stats().num_free_blocks == srv.engine.stats().num_blocks
