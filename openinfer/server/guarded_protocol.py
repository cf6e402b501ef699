"""uvicorn's h11 protocol with the timers and the cap of ``connections.py`` (the why is there): a request head
must be complete within ``header_timeout_s``, a connection the server waits on must progress within
``idle_timeout_s``, and connections beyond ``max_connections`` get a canned 503 before anything is read."""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from openinfer.server.connections import ConnectionSettings, conn_log

_REFUSED_BODY = b'{"error": {"message": "too many open connections", "type": "service_unavailable", "code": 503}}'
_REFUSED = (  # the answer beyond --max-connections, written before anything is read
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY)
)
_HEAD_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: 26\r\n\r\nrequest head not complete\n"
)


class GuardedH11Protocol(H11Protocol):
    settings: ConnectionSettings
    max_connections: int

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._got_bytes = False  # of the request head being waited for

    # -- the cap: refuse before reading ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._refused = True
            self.transport = transport
            transport.write(_REFUSED)
            transport.close()  # sends what was written, then closes; nothing is read
            conn_log(logging.WARNING, "cap", "refused a connection: %d open, the limit is %d (--max-connections)",
                     len(self.connections), self.max_connections)
            return
        super().connection_made(transport)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._cancel_timers()
        super().connection_lost(exc)

    # -- progress: each event re-evaluates which timer applies ------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        super().data_received(data)
        self._watch(progress=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._got_bytes = False
        self._watch()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm_idle()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel(idle=True)
        self._watch()

    def _watch(self, progress: bool = False) -> None:
        if self.transport is None or self.transport.is_closing():
            return self._cancel_timers()
        state = self.conn.their_state
        if state is h11.IDLE and (self.cycle is None or self.cycle.response_complete):
            # Waiting for a request head. Before its first byte on a kept-alive connection, uvicorn's keep-alive
            # timer applies; otherwise the head must be complete within the bound of its start.
            if self.timeout_keep_alive_task is None and self._head_timer is None and self.settings.header_timeout_s:
                self._head_timer = self.loop.call_later(self.settings.header_timeout_s, self._head_timed_out)
            self._cancel(idle=True)
        elif state is h11.SEND_BODY:
            self._cancel(head=True)
            if progress or self._idle_timer is None:
                self._arm_idle()
        else:  # the request is in; the app is working on it (or the connection is closing)
            self._cancel(head=True)
            if not (self.flow is not None and self.flow.write_paused):
                self._cancel(idle=True)

    def _arm_idle(self) -> None:
        self._cancel(idle=True)
        if self.settings.idle_timeout_s:
            self._idle_timer = self.loop.call_later(self.settings.idle_timeout_s, self._idle_timed_out)

    def _cancel(self, head: bool = False, idle: bool = False) -> None:
        if head and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if idle and self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _cancel_timers(self) -> None:
        self._cancel(head=True, idle=True)

    # -- timeouts -----------------------------------------------------------------------------------------------
    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._got_bytes:
            self.transport.write(_HEAD_TIMEOUT)
        conn_log(logging.INFO, "head", "closed a connection without a complete request head after %gs "
                 "(--header-timeout-s)", self.settings.header_timeout_s)
        self._close()

    def _idle_timed_out(self) -> None:
        self._idle_timer = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY and self.flow.read_paused:
            return self._arm_idle()  # we stopped reading (the app is slow to take the body): not the client's fault
        conn_log(logging.INFO, "idle", "closed a connection idle for %gs while %s (--idle-timeout-s)",
                 self.settings.idle_timeout_s,
                 "writing to it" if self.flow.write_paused else "reading its request body")
        self._close()

    def _close(self) -> None:
        if self.conn.our_state is not h11.ERROR:
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:  # mid-response: h11 refuses a clean close; the socket closes anyway
                pass
        if self.flow is not None and self.flow.write_paused:
            self.transport.abort()  # the peer is not reading: do not wait for the buffer to drain
        else:
            self.transport.close()
