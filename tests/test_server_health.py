"""Honest health, with faults injected into a real ``openinfer serve`` (OPENINFER_FAULT_INJECT, test-only):

* every forward raising: each request gets a clean 500 / error event, and /health/ready turns 503 after
  --ready-max-step-failures failed steps, ready again once a step succeeds;
* a hung step: /reset_prefix_cache answers 503 within its bounded wait, /health turns 503, the open requests end
  with errors, and the process exits non-zero (the step watchdog);
* the engine thread dying: the open requests end with errors and the process exits non-zero;
* --request-timeout-s: a request running longer is answered 504 (an error event when streaming) and its KV
  blocks go back to the pool.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_utils import ServerProcess, shared_checkpoint

from openinfer.engine.fault_inject import ENV, parse

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # fault-injected server processes; time bounds of a few seconds

ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "256", "--served-model-name", "tiny"]
BODY = {"model": "tiny", "prompt": "health", "ignore_eos": True, "temperature": 0}


# Each fault test gets its own server (a fault leaves it sick or gone). The four start together and the tests run
# once all are up: the startups (mostly one core each) overlap on the two cores instead of running one after another,
# and no test's timing bounds run while other servers are still starting.
SERVERS = {
    "forward_raises": (("--ready-max-step-failures", "3"), "forward_raises:3"),
    "step_hangs": (("--step-timeout-s", "6"), "step_hangs:3"),
    "engine_dies": ((), "engine_dies:3"),
    "slow_steps": (("--request-timeout-s", "1"), "slow_steps:0.02"),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    ckpt = shared_checkpoint(tmp_path_factory)
    started: dict[str, ServerProcess] = {}
    try:
        for name, (flags, fault) in SERVERS.items():
            started[name] = ServerProcess(ckpt, *ARGS, *flags, env={ENV: fault}, wait=False)
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        for s in started.values():
            s.stop()


def _complete(url: str, max_tokens: int = 4, timeout: float = 30) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={**BODY, "max_tokens": max_tokens}, timeout=timeout)


class _Call(threading.Thread):
    """One completion in a thread. Streaming: the SSE events (``first`` set at the first one); else the
    response."""

    def __init__(self, url: str, max_tokens: int, stream: bool) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.stream = url, max_tokens, stream
        self.first = threading.Event()
        self.events: list = []
        self.status: int | None = None
        self.body: dict | None = None
        self.failure: BaseException | None = None
        self.start()

    def run(self) -> None:
        body = {**BODY, "max_tokens": self.max_tokens, "stream": self.stream}
        try:
            if not self.stream:
                r = httpx.post(self.url + "/v1/completions", json=body, timeout=60)
                self.status, self.body = r.status_code, r.json()
                return
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    self.body = json.loads(r.read())
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.first.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.failure = e
        finally:
            self.first.set()

    def result(self, timeout: float = 30):
        self.join(timeout)
        assert not self.is_alive(), "the request hung"
        assert self.failure is None, repr(self.failure)
        return self

    @property
    def error_event(self) -> dict | None:
        return next((e["error"] for e in self.events if isinstance(e, dict) and "error" in e), None)


def _status(url: str, path: str) -> int | None:
    try:
        return httpx.get(url + path, timeout=2).status_code
    except httpx.HTTPError:
        return None


def _wait_exit(s: ServerProcess, within_s: float) -> int:
    try:
        return s.proc.wait(within_s)
    except Exception:
        raise AssertionError(f"the server did not exit within {within_s}s:\n{s.log()}") from None


def test_fault_spec_parsing():
    assert parse("forward_raises").arg is None and parse("forward_raises:3").arg == 3
    assert parse("step_hangs:2").kind == "step_hangs"
    for bad in ("nope", "slow_steps", "forward_raises:x", "forward_raises:-1"):
        with pytest.raises(ValueError, match=ENV):
            parse(bad)


def test_failing_forwards_flip_readiness_until_a_step_succeeds(servers):
    # The first 3 forwards raise, then they succeed again.
    with servers["forward_raises"] as s:
        assert _status(s.url, "/health/ready") == 200
        t0 = time.monotonic()
        r = _complete(s.url)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
        assert _status(s.url, "/health/ready") == 200  # one failure is not yet a sick server
        stream = _Call(s.url, 4, stream=True).result()
        assert stream.status == 200 and stream.error_event["code"] == "engine_error", stream.events
        assert stream.events[-1] == "[DONE]"
        r = _complete(s.url)
        assert r.status_code == 500, r.text
        ready = httpx.get(s.url + "/health/ready", timeout=5)
        assert ready.status_code == 503, ready.text
        assert "3 engine steps failed" in ready.json()["reason"] and ready.json()["consecutive_failed_steps"] == 3
        assert time.monotonic() - t0 < 10  # clean errors at once: nothing waits on a timeout
        assert _status(s.url, "/health") == 200  # alive: the engine loop runs, it is the forwards that fail
        # A not-ready server still takes requests; the first that succeeds makes it ready again.
        r = _complete(s.url)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert _status(s.url, "/health/ready") == 200
        m = s.metrics()
        assert m["openinfer:kv_cache_free_blocks"] == m["openinfer:kv_cache_total_blocks"]  # no block leaked


def test_hung_step_fails_liveness_and_exits(servers):
    # The step after 3 steps with work hangs: the stream is running by then.
    with servers["step_hangs"] as s:
        stream = _Call(s.url, 200, stream=True)
        assert stream.first.wait(20) and stream.events, stream.failure
        t0 = time.monotonic()
        plain = _Call(s.url, 4, stream=False)  # admitted while the step hangs
        r = httpx.post(s.url + "/reset_prefix_cache", timeout=30)
        assert r.status_code == 503 and "did not answer within" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 5.8  # the bounded wait, not 30 s (and not the watchdog's exit)
        seen_503 = False
        while s.alive and time.monotonic() - t0 < 20:
            status = _status(s.url, "/health")
            seen_503 |= status == 503
            if status == 503:
                assert _status(s.url, "/health/ready") in (503, None)
            time.sleep(0.05)
        code = _wait_exit(s, 20)
        assert code != 0 and seen_503, (code, seen_503, s.log())
        stream.result()
        assert stream.status == 200 and "wedged" in stream.error_event["message"], stream.events
        plain.result()
        assert plain.status == 503 and "wedged" in plain.body["error"]["message"], plain.body
        assert "exits for its supervisor to restart it" in s.log()


def test_dead_engine_thread_fails_requests_and_exits(servers):
    # The step after 3 steps with work dies. The stream must be admitted before that (its first token means it was),
    # else it is the plain request's steps that kill the engine and the stream is answered 503 at the door.
    with servers["engine_dies"] as s:
        stream = _Call(s.url, 200, stream=True)
        assert stream.first.wait(20) and stream.events, stream.failure
        plain = _Call(s.url, 200, stream=False)
        code = _wait_exit(s, 20)
        assert code == 1, s.log()
        stream.result()
        assert stream.status == 200 and "engine_dies" in stream.error_event["message"], stream.events
        plain.result()
        assert plain.status in (500, 503) and "error" in plain.body, plain.body
        assert "engine core thread died" in s.log()


def test_request_timeout_answers_504_and_frees_blocks(servers):
    with servers["slow_steps"] as s:
        stream = _Call(s.url, 500, stream=True)
        t0 = time.monotonic()
        r = _complete(s.url, max_tokens=500)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
        assert time.monotonic() - t0 < 5
        stream.result()
        assert stream.status == 200 and stream.error_event["code"] == "timeout", stream.events[-3:]
        assert any(e.get("choices") for e in stream.events if isinstance(e, dict))  # it ran before timing out
        r = _complete(s.url, max_tokens=4)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 5
        while True:
            m = s.metrics()
            if m["openinfer:kv_cache_free_blocks"] == m["openinfer:kv_cache_total_blocks"] or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert m["openinfer:kv_cache_free_blocks"] == m["openinfer:kv_cache_total_blocks"], m
        assert _status(s.url, "/health/ready") == 200
