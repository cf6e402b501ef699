"""Connection hygiene on a real ``openinfer serve`` process (issue 17, must-show 4): idle and slowloris sockets are
closed after the header timeout while /health keeps answering, a body that stalls is closed after the idle timeout,
kept-alive connections after the keep-alive timeout, connections beyond --max-connections get a 503 at once,
clients gone mid-upload log no tracebacks; plus the Bearer scheme and the model id /v1/models shows.

Timeouts are short (1-2 s) so the whole module runs in well under 30 s after the server is up."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from server_utils import ServerProcess, shared_checkpoint

from openinfer.bench import slowloris
from openinfer.server.connections import (
    ConnectionSettings,
    RateLimitedLog,
    _exception_handler,
    _RateLimitFilter,
    default_max_connections,
)

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # asserts timeouts to within 1 s

KEY = "sk-conn"
HEADER_S, IDLE_S, KEEP_ALIVE_S, CAP = 2.0, 1.5, 1.0, 400
N_IDLE, N_SLOW = 200, 60
HEALTH_BOUND_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(
        shared_checkpoint(tmp_path_factory),
        "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "64", "--max-num-seqs", "4",
        "--header-timeout-s", str(HEADER_S), "--idle-timeout-s", str(IDLE_S),
        "--timeout-keep-alive", str(KEEP_ALIVE_S), "--max-connections", str(CAP),
        api_key=KEY,
    ) as s:
        yield s


def _log_lines(server) -> list[str]:
    server._log.flush()
    return server.log_path.read_text().splitlines()


def test_idle_and_slowloris_flood(server):
    before = len(_log_lines(server))
    report = slowloris.flood("127.0.0.1", server.port, N_IDLE, N_SLOW, wait_s=HEADER_S + 3, slow_interval_s=0.5,
                             probe_interval_s=0.05)
    assert report["connect_failed"] == 0, report
    for kind, n in (("idle", N_IDLE), ("slow", N_SLOW)):
        r = report[kind]
        assert r["opened"] == n and r["closed_by_server"] == n, report  # every one closed by the server ...
        assert r["closed_after_s_min"] >= HEADER_S - 0.1, report  # ... not before the header timeout ...
        assert r["closed_after_s_max"] <= HEADER_S + 1.5, report  # ... and soon after it
    assert report["slow"]["answered_408"] == N_SLOW and report["idle"]["answered_408"] == 0, report
    h = report["health"]
    assert h["errors"] == 0 and h["probes"] >= 20, report
    assert h["latency_s_max"] < HEALTH_BOUND_S, report
    new = _log_lines(server)[before:]
    assert not [ln for ln in new if "Traceback" in ln], new
    assert len(new) <= 4, new  # one rate-limited line per kind of event, not one per socket


def test_over_cap_refused_at_once(server):
    n = CAP + 40
    report = slowloris.over_cap("127.0.0.1", server.port, n, wait_s=HEADER_S + 1.5)
    assert report["connect_failed"] == 0, report
    # The server holds CAP (less the probes' sockets still closing) and refuses the rest with a 503 before reading
    # anything; the held ones are closed later, by the header timeout.
    assert 40 <= report["answered_503"] <= 45, report
    assert report["held_closed_after_s_min"] is not None, report
    assert report["refused_closed_after_s_max"] < report["held_closed_after_s_min"], report
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # the cap frees as sockets close


def test_stalled_body_closed_after_idle_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        t0 = time.monotonic()
        s.settimeout(IDLE_S + 3)
        while s.recv(4096):  # the app's answer to the disconnect goes nowhere: EOF is what the client sees
            pass
        waited = time.monotonic() - t0
    assert IDLE_S - 0.1 <= waited <= IDLE_S + 1.0, waited


def test_keep_alive_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(KEEP_ALIVE_S + 3)
        data = b""
        while not data.endswith(b'{"status":"ok"}'):
            data += s.recv(4096)
        assert data.startswith(b"HTTP/1.1 200"), data
        t0 = time.monotonic()
        assert s.recv(4096) == b""
        waited = time.monotonic() - t0
    assert KEEP_ALIVE_S - 0.1 <= waited <= KEEP_ALIVE_S + 1.0, waited


def test_mid_upload_and_mid_stream_disconnects_are_quiet(server):
    before = len(_log_lines(server))
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
    for _ in range(200):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(head + b"{" * 1000)
    body = json.dumps({"prompt": "hello", "max_tokens": 200, "stream": True, "ignore_eos": True}).encode()
    for _ in range(20):  # and mid-stream: gone after the first chunk
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(head.replace(b"100000", str(len(body)).encode()) + body)
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health", timeout=5).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    # a real request still works afterwards
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=30,
                   json={"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200, r.text
    time.sleep(0.3)
    new = _log_lines(server)[before:]
    assert not [ln for ln in new if "Traceback" in ln or "Exception in ASGI" in ln], new[:20]
    assert len(new) <= 3, new


@pytest.mark.parametrize("value", [f"bearer {KEY}", f"BEARER {KEY}", f"Bearer   {KEY}", f"bEaReR {KEY}"])
def test_bearer_scheme_case_insensitive(server, value):
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": value}, timeout=5)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", [KEY, f"Basic {KEY}", f"Bearer {KEY}x", "Bearer", f"Bearer{KEY}", ""])
def test_bad_credentials_refused(server, value):
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": value}, timeout=5)
    assert r.status_code == 401, r.text


def test_models_shows_no_path(server, tmp_path_factory):
    path = str(shared_checkpoint(tmp_path_factory))
    cards = httpx.get(server.url + "/v1/models", headers=server.headers, timeout=5).json()["data"]
    assert [c["id"] for c in cards] == ["server-tiny-llama"]  # the checkpoint directory's base name
    text = json.dumps(cards)
    assert "/" not in text and path not in text, text
    # The shown id is accepted as `model`; so is the --model path that clients sent before.
    for model in ("server-tiny-llama", path):
        r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=30,
                       json={"model": model, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "server-tiny-llama"
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=30,
                   json={"model": "other", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "does not exist" in r.text, r.text


def test_settings_and_defaults():
    assert default_max_connections(1024) == 768  # a quarter of the fds (256 at least) kept for the rest
    assert default_max_connections(65536) == 49152
    assert default_max_connections(600) == 344
    assert default_max_connections(20) == 16
    with pytest.raises(ValueError, match="--header-timeout-s"):
        ConnectionSettings(header_timeout_s=-1)
    with pytest.raises(ValueError, match="--limit-concurrency"):
        ConnectionSettings(limit_concurrency=0)
    kw = ConnectionSettings(limit_concurrency=8, timeout_keep_alive_s=3).uvicorn_kwargs()
    assert kw["limit_concurrency"] == 8 and kw["timeout_keep_alive"] == 3
    assert kw["http"].max_connections == default_max_connections()
    # ... and uvicorn takes them as they are: its protocol, its limit, our loop with the quiet exception handler
    import uvicorn

    async def app(scope, receive, send):
        pass

    cfg = uvicorn.Config(app, **kw)
    cfg.load()
    assert cfg.http_protocol_class is kw["http"] and cfg.limit_concurrency == 8 and cfg.timeout_keep_alive == 3
    loop = cfg.get_loop_factory()()
    try:
        assert loop.get_exception_handler() is _exception_handler
    finally:
        loop.close()


def test_rate_limited_log(caplog):
    import logging

    log = RateLimitedLog(logging.getLogger("test-rl"), interval_s=60)
    with caplog.at_level(logging.INFO, "test-rl"):
        for _ in range(1000):
            log(logging.WARNING, "k", "event %s", "x")
        log.interval_s = 0
        log(logging.WARNING, "k", "event %s", "x")
    assert [r.getMessage() for r in caplog.records] == ["event x", "event x (1000 times since the last such message)"]


def test_rate_limited_log_says_the_count_after_a_burst(caplog):
    import asyncio
    import logging

    log = RateLimitedLog(logging.getLogger("test-rl2"), interval_s=0.2)

    async def burst():
        for _ in range(50):
            log(logging.INFO, "k", "closed")
        await asyncio.sleep(0.4)  # no further event: the count comes out when the interval is over

    with caplog.at_level(logging.INFO, "test-rl2"):
        asyncio.run(burst())
    assert [r.getMessage() for r in caplog.records] == ["closed", "closed (49 times since the last such message)"]


def test_uvicorn_repeats_rate_limited():
    import logging

    f = _RateLimitFilter()

    def rec(msg):
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, None, None)

    kept = [r for r in (rec("Exceeded concurrency limit.") for _ in range(500)) if f.filter(r)]
    assert [r.msg for r in kept] == ["Exceeded concurrency limit."]
    assert f.filter(rec("something else")) and f.filter(rec("something else"))


def test_accept_out_of_fds_is_one_line(caplog):
    import asyncio
    import errno
    import logging

    from openinfer.server import connections

    connections.conn_log._last.clear()
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(100):  # asyncio calls this on every failed accept (it retries each second)
                _exception_handler(loop, {"message": "socket.accept() out of system resource",
                                          "exception": OSError(errno.EMFILE, "Too many open files")})
    finally:
        loop.close()
    lines = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None and "Too many open files" in lines[0].getMessage()


def test_client_that_stops_reading_is_closed_after_idle_timeout():
    """The write side of --idle-timeout-s, on the protocol with an in-memory transport: a response the client
    stops reading (the transport pauses writing) is aborted after the idle timeout, not held forever."""
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState

    from openinfer.server.connections import make_protocol_class

    class Transport(asyncio.Transport):
        def __init__(self, protocol_ref: list) -> None:
            super().__init__()
            self.closing = self.aborted = False
            self.protocol_ref = protocol_ref

        def get_extra_info(self, name, default=None):
            return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)

        def write(self, data) -> None:
            pass

        def is_closing(self) -> bool:
            return self.closing

        def close(self) -> None:
            self.closing = True

        def abort(self) -> None:
            self.closing = self.aborted = True
            asyncio.get_running_loop().call_soon(self.protocol_ref[0].connection_lost, None)

        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            pass

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while not transport.closing:
            await send({"type": "http.response.body", "body": b"x" * 1000, "more_body": True})
            await asyncio.sleep(0.01)

    async def main() -> tuple[float, bool]:
        config = uvicorn.Config(app, lifespan="off", log_level="warning")
        config.load()
        proto = make_protocol_class(ConnectionSettings(idle_timeout_s=0.3))(
            config=config, server_state=ServerState(), app_state={})
        ref[0] = proto
        proto.connection_made(transport)
        proto.data_received(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.1)
        proto.pause_writing()  # what the transport does when the client stops reading and its buffer fills
        t0 = time.monotonic()
        while not transport.closing and time.monotonic() - t0 < 3:
            await asyncio.sleep(0.01)
        waited = time.monotonic() - t0
        await asyncio.sleep(0.1)  # the app sees the disconnect and returns
        return waited, all(t.done() for t in proto.tasks)

    ref: list = [None]
    transport = Transport(ref)
    waited, app_done = asyncio.run(main())
    assert transport.aborted and 0.25 <= waited <= 1.0, waited
    assert app_done
