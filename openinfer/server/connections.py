"""Connection hygiene for ``openinfer serve``: header / idle / keep-alive timeouts, a cap on open connections,
uvicorn's ``--limit-concurrency``, and logging that stays quiet under floods (idle sockets, client disconnects,
running out of file descriptors).

Why a protocol subclass: uvicorn's HTTP protocols (h11 and httptools alike) only time out a keep-alive connection
*after* a response. A connection that never sends a byte, or sends its request head one byte a second (slowloris),
or stops half-way through its body, is held forever; ~20k of them exhaust the file descriptors and the server stops
answering everyone. uvicorn has no option for this (its issue #157 has listed "--timeout-request-start" and
"--timeout-request-complete" as to-do since 2018; h11_max_incomplete_event_size bounds a head's size, not its
time), and ASGI middleware runs only once the head is parsed, so ``GuardedH11Protocol`` adds the timers nginx has
(client_header_timeout, client_body_timeout, send_timeout) on top of uvicorn's h11 protocol, and refuses
connections beyond the cap with a canned 503 before reading anything. It is built on the h11 protocol (what uvicorn
picks here: httptools is not installed) and is passed to uvicorn explicitly, so the same code runs everywhere.

* header timeout: a request head (request line + headers) must arrive complete within ``header_timeout_s`` of the
  connection opening, or of its first byte after a previous response; else 408 (if it sent anything) and close.
* idle timeout: while the server waits on the client - reading a request body, or writing to a client that does
  not read - ``idle_timeout_s`` without progress closes the connection (the request sees a disconnect and is
  aborted). A request the engine is working on is not idle: its length is the business of ``--request-timeout-s``.
* keep-alive timeout: uvicorn's own, between requests on one connection.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

FD_HEADROOM = 256  # at least this many descriptors left for everything but client connections: model files, pipes, ZeroMQ, logs
MAX_NOFILE = 65536  # serve raises its soft RLIMIT_NOFILE up to this (and the hard limit), as vLLM does
LOG_INTERVAL_S = 10.0  # a repeated connection event is logged at most this often, with the count in between


def raise_nofile_limit(target: int = MAX_NOFILE) -> int:
    """Raise the soft RLIMIT_NOFILE towards ``target`` (never above the hard limit); return the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):  # a container may refuse: keep the limit there is
            pass
    return soft


def default_max_connections(nofile: int | None = None) -> int:
    """Open connections the server accepts: the soft descriptor limit less a quarter of it (256 at least) for
    everything else, so client sockets alone can never run the process out of fds."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if nofile == resource.RLIM_INFINITY:
            nofile = MAX_NOFILE
    return max(16, min(nofile - FD_HEADROOM, nofile * 3 // 4))


@dataclass(frozen=True)
class ConnectionSettings:
    max_connections: int = 0  # 0: default_max_connections() of the limit at start-up
    limit_concurrency: int | None = None  # uvicorn's: connections + tasks beyond it get 503
    timeout_keep_alive_s: float = 5.0
    header_timeout_s: float | None = 10.0
    idle_timeout_s: float | None = 60.0

    def __post_init__(self) -> None:
        if self.max_connections < 0:
            raise ValueError(f"--max-connections must be >= 0 (0 = derived from the fd limit), got "
                             f"{self.max_connections}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"--limit-concurrency must be >= 1 (or 0 for none), got {self.limit_concurrency}")
        if not self.timeout_keep_alive_s > 0:
            raise ValueError(f"--timeout-keep-alive must be > 0, got {self.timeout_keep_alive_s}")
        for name in ("header_timeout_s", "idle_timeout_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 (or 0 for none), got {v}")

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("connections")
        g.add_argument("--max-connections", type=int, default=0,
                       help="open connections beyond this are answered 503 and closed before anything is read "
                            "(default 0: 3/4 of the soft fd limit, which serve raises up to 65536, keeping 256 at least for the "
                            "rest)")
        g.add_argument("--limit-concurrency", type=int, default=0,
                       help="uvicorn's: requests beyond this many connections + running requests get 503 "
                            "(default 0: none; --max-connections still applies)")
        g.add_argument("--timeout-keep-alive", type=float, default=ConnectionSettings.timeout_keep_alive_s,
                       help="close a keep-alive connection after this long without a new request (seconds)")
        g.add_argument("--header-timeout-s", type=float, default=ConnectionSettings.header_timeout_s,
                       help="close a connection whose request head (request line and headers) is not complete "
                            "this long after it opened or started the request; 408 if it sent any (0 = none)")
        g.add_argument("--idle-timeout-s", type=float, default=ConnectionSettings.idle_timeout_s,
                       help="close a connection that makes no progress this long while the server waits on it: "
                            "reading a request body, or writing to a client that does not read (0 = none)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ConnectionSettings:
        return cls(
            max_connections=args.max_connections,
            limit_concurrency=args.limit_concurrency or None,
            timeout_keep_alive_s=args.timeout_keep_alive,
            header_timeout_s=args.header_timeout_s or None,
            idle_timeout_s=args.idle_timeout_s or None,
        )

    def resolved_max_connections(self) -> int:
        return self.max_connections or default_max_connections()

    def uvicorn_kwargs(self) -> dict:
        """The uvicorn.Config arguments: its own limits, our protocol, and the quiet event loop."""
        return {
            "http": make_protocol_class(self),
            "limit_concurrency": self.limit_concurrency,
            "timeout_keep_alive": self.timeout_keep_alive_s,
            "loop": "openinfer.server.connections:quiet_loop",
        }


class RateLimitedLog:
    """One line per kind of event per ``interval_s`` at most, saying how many happened since the last line: a
    flood of the same event (ten thousand idle sockets timing out) costs a line every ten seconds."""

    def __init__(self, log: logging.Logger, interval_s: float = LOG_INTERVAL_S) -> None:
        self.log = log
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}
        self._flush_pending: set[str] = set()

    def due(self, key: str) -> int:
        """How many ``key`` events this one makes since the last line if a line is due now; else 0."""
        n = self._count.get(key, 0) + 1
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self.interval_s:
            self._count[key] = n
            return 0
        self._last[key], self._count[key] = now, 0
        return n

    def __call__(self, level: int, key: str, msg: str, *args) -> None:
        n = self.due(key)
        if n:
            self._emit(level, msg, args, n)
        elif key not in self._flush_pending:
            # The count of a burst that ends within the interval would otherwise wait for the next such event
            # (maybe never): say it when the interval is over.
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._flush_pending.add(key)
            delay = self._last[key] + self.interval_s - time.monotonic()
            loop.call_later(max(delay, 0.0), self._flush, level, key, msg, args)

    def _flush(self, level: int, key: str, msg: str, args: tuple) -> None:
        self._flush_pending.discard(key)
        n = self._count.get(key, 0)
        if n:
            self._last[key], self._count[key] = time.monotonic(), 0
            self._emit(level, msg, args, n)

    def _emit(self, level: int, msg: str, args: tuple, n: int) -> None:
        if n > 1:
            msg += " (%d times since the last such message)"
            args = (*args, n)
        self.log.log(level, msg, *args)


conn_log = RateLimitedLog(logger)


def make_protocol_class(settings: ConnectionSettings) -> type:
    """``guarded_protocol.GuardedH11Protocol`` bound to these settings (uvicorn instantiates the class it is given)."""
    from openinfer.server.guarded_protocol import GuardedH11Protocol

    max_connections = settings.resolved_max_connections()
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"settings": settings, "max_connections": max_connections, "__module__": GuardedH11Protocol.__module__})


# uvicorn logs these once per request; a flood of them (every request over --limit-concurrency, a scanner sending
# junk) would write a line each.
_UVICORN_REPEATS = ("Exceeded concurrency limit.", "Invalid HTTP request received.")


class _RateLimitFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.limiter = RateLimitedLog(logger)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg not in _UVICORN_REPEATS:
            return True
        n = self.limiter.due(record.msg)
        if n > 1:
            record.msg = f"{record.msg} ({n} times since the last such message)"
        return n > 0


def quiet_uvicorn_logs() -> None:
    """Rate-limit uvicorn's per-request warnings (call after uvicorn.Config, which configures its loggers)."""
    logging.getLogger("uvicorn.error").addFilter(_RateLimitFilter())


# -- the event loop: EMFILE and friends without a traceback flood ---------------------------------------------------
_QUIET = {
    "socket.accept() out of system resource": "out of file descriptors or memory on accept (%s): new connections "
    "wait until some close (open: see /metrics process_open_fds; raise the fd limit or lower --max-connections)",
}


def _exception_handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """asyncio logs every loop-level error with a full traceback. The resource errors on accept repeat every
    second while the process is out of descriptors, and a client gone mid-write raises in transport callbacks:
    those get one rate-limited line; everything else goes to the default handler unchanged."""
    message = context.get("message", "")
    exc = context.get("exception")
    if message in _QUIET:
        conn_log(logging.WARNING, message, _QUIET[message], exc)
        return
    if isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        conn_log(logging.INFO, "peer-gone", "a client went away mid-transfer: %s", exc)
        return
    loop.default_exception_handler(context)


def quiet_loop() -> asyncio.AbstractEventLoop:
    """uvicorn's ``loop=`` hook (a custom value names a loop factory): its asyncio loop with
    ``_exception_handler`` installed."""
    from uvicorn.loops.asyncio import asyncio_loop_factory

    loop = asyncio_loop_factory()()
    loop.set_exception_handler(_exception_handler)
    return loop
