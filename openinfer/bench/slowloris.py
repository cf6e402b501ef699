"""A slowloris / idle-connection flood against an HTTP server on loopback, measuring what the server does with it.

Opens ``n_idle`` sockets that never send a byte and ``n_slow`` that send a request head one byte every
``slow_interval_s`` and never finish it, probes ``/health`` on a fresh connection every ``probe_interval_s``
meanwhile, and records when the server closes each socket (and whether it answered 408 / 503 first). One thread, a
selector: thousands of sockets cost nothing but their descriptors. Used by ``scripts/slowloris.py`` and
``tests/test_server_connections.py``.
"""

from __future__ import annotations

import resource
import multiprocessing
import selectors
import socket
import time
from dataclasses import dataclass, field

SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: "  # then one more byte per interval, no end


@dataclass
class _Sock:
    kind: str
    sock: socket.socket
    opened_s: float
    closed_s: float | None = None
    first_bytes: bytes = b""
    sent: int = 0


@dataclass
class HealthProbe:
    """GET /health on a new connection every ``interval_s``, latencies in seconds. It runs in a child process: in
    a thread of the flooding process it would wait on the GIL while the flood's thread handles thousands of
    sockets, and measure the client instead of the server."""

    host: str
    port: int
    interval_s: float = 0.1
    timeout_s: float = 5.0
    latencies: list[float] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)  # seconds since the probe started
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=self._run, args=(send,), daemon=True)

    def start(self) -> HealthProbe:
        self._proc.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._recv.poll(self.timeout_s + 5):
            self.latencies, self.sent_at, self.errors = self._recv.recv()
        self._proc.join(5)
        return self.report()

    def _run(self, send) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                status = _get(self.host, self.port, "/health", self.timeout_s)
                if status != 200:
                    self.errors.append(f"status {status}")
            except OSError as e:
                self.errors.append(f"{type(e).__name__}: {e}")
            self.latencies.append(time.monotonic() - t0)
            self.sent_at.append(t0 - start)
            self._stop.wait(self.interval_s)
        send.send((self.latencies, self.sent_at, self.errors))

    def report(self) -> dict:
        slowest = sorted(zip(self.latencies, self.sent_at), reverse=True)[:5]
        return {"probes": len(self.latencies), "errors": len(self.errors), "first_errors": self.errors[:3],
                **_quantiles(self.latencies, "latency_s", (50, 99)),
                "slowest_at_s": [{"sent_at_s": round(t, 2), "latency_s": round(lat, 4)} for lat, t in slowest]}


def _get(host: str, port: int, path: str, timeout_s: float) -> int:
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else -1


def _quantiles(xs: list[float], name: str, qs: tuple[int, ...] = (50,)) -> dict:
    if not xs:
        return {f"{name}_p{q}": None for q in qs} | {f"{name}_max": None}
    s = sorted(xs)
    out = {f"{name}_p{q}": round(s[min(len(s) - 1, int(len(s) * q / 100))], 4) for q in qs}
    out[f"{name}_max"] = round(s[-1], 4)
    return out


def raise_nofile(need: int) -> int:
    """Raise this process's soft descriptor limit to at least ``need`` if the hard limit allows; return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    return soft


def open_sockets(host: str, port: int, n: int, kind: str, timeout_s: float = 10.0) -> tuple[list[_Sock], int]:
    """``n`` connected non-blocking sockets (connect failures counted, not raised)."""
    out, failed = [], 0
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(timeout_s)
        try:
            s.connect((host, port))
        except OSError:
            s.close()
            failed += 1
            continue
        s.setblocking(False)
        out.append(_Sock(kind, s, time.monotonic()))
    return out, failed


def watch(socks: list[_Sock], until_s: float, slow_interval_s: float = 1.0) -> None:
    """Until every socket is closed by the peer or ``until_s`` (monotonic) passes: read what the server sends,
    note when it closes, and feed the slow sockets one header byte per interval."""
    sel = selectors.DefaultSelector()
    for st in socks:
        sel.register(st.sock, selectors.EVENT_READ, st)
    open_count = len(socks)
    next_feed = time.monotonic()
    while open_count and time.monotonic() < until_s:
        now = time.monotonic()
        if now >= next_feed:
            for st in socks:
                if st.kind == "slow" and st.closed_s is None:
                    chunk = SLOW_HEAD if st.sent == 0 else b"a"
                    try:
                        st.sock.send(chunk)
                        st.sent += len(chunk)
                    except OSError:
                        pass  # closed under us: the read side notices
            next_feed = now + slow_interval_s
        for key, _ in sel.select(timeout=min(0.05, max(0.0, until_s - now))):
            st = key.data
            try:
                data = st.sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:  # reset: closed all the same
                data = b""
            if data:
                if len(st.first_bytes) < 64:
                    st.first_bytes += data[: 64 - len(st.first_bytes)]
                continue
            st.closed_s = time.monotonic()
            sel.unregister(st.sock)
            open_count -= 1
    sel.close()


def summarize(socks: list[_Sock]) -> dict:
    out: dict = {"opened": len(socks)}
    for kind in sorted({s.kind for s in socks}):
        mine = [s for s in socks if s.kind == kind]
        closed = [s.closed_s - s.opened_s for s in mine if s.closed_s is not None]
        out[kind] = {
            "opened": len(mine),
            "closed_by_server": len(closed),
            "answered_408": sum(s.first_bytes.startswith(b"HTTP/1.1 408") for s in mine),
            "answered_503": sum(s.first_bytes.startswith(b"HTTP/1.1 503") for s in mine),
            **_quantiles(closed, "closed_after_s", (50,)),
            "closed_after_s_min": round(min(closed), 4) if closed else None,
        }
    return out


def close_all(socks: list[_Sock]) -> None:
    for s in socks:
        s.sock.close()


def flood(host: str, port: int, n_idle: int, n_slow: int, wait_s: float, slow_interval_s: float = 1.0,
          probe_interval_s: float = 0.1) -> dict:
    """Open the flood, probe /health throughout, wait up to ``wait_s`` for the server to close it all."""
    raise_nofile(n_idle + n_slow + 256)
    probe = HealthProbe(host, port, probe_interval_s).start()
    t0 = time.monotonic()
    idle, failed_idle = open_sockets(host, port, n_idle, "idle")
    slow, failed_slow = open_sockets(host, port, n_slow, "slow")
    open_s = time.monotonic() - t0
    socks = idle + slow
    try:
        watch(socks, time.monotonic() + wait_s, slow_interval_s)
    finally:
        close_all(socks)
    report = summarize(socks)
    report["connect_failed"] = failed_idle + failed_slow
    report["open_all_s"] = round(open_s, 3)  # the probe started just before: sent_at_s < this is the open burst
    report["health"] = probe.stop()
    return report


def over_cap(host: str, port: int, n: int, wait_s: float = 2.0) -> dict:
    """Open ``n`` idle sockets at once (meant to pass the server's connection cap) and report how many the server
    refused (a 503 then close, or a plain close) within ``wait_s``, and how fast."""
    raise_nofile(n + 256)
    t0 = time.monotonic()
    socks, failed = open_sockets(host, port, n, "burst")
    open_s = time.monotonic() - t0
    try:
        watch(socks, time.monotonic() + wait_s)
    finally:
        close_all(socks)
    report = summarize(socks)["burst"]
    refused = [s.closed_s - s.opened_s for s in socks if s.first_bytes.startswith(b"HTTP/1.1 503") and s.closed_s]
    report.update(_quantiles(refused, "refused_closed_after_s", (50,)))
    held = [s.closed_s - s.opened_s for s in socks if not s.first_bytes.startswith(b"HTTP/1.1 503") and s.closed_s]
    report["held_closed_after_s_min"] = round(min(held), 4) if held else None  # by a timeout, if within wait_s
    report["connect_failed"] = failed
    report["open_all_s"] = round(open_s, 3)  # the close times above include up to this much of the client's own
    return report
