"""uvicorn's server with a drain on the first SIGTERM/SIGINT instead of an immediate stop, and an exit with a
non-zero code when the engine dies (a supervisor then restarts it; a half-alive server answering 503 forever
helps nobody)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading

import uvicorn
from fastapi import FastAPI

from openinfer.server.api import drain

logger = logging.getLogger(__name__)

ENGINE_DEATH_GRACE_S = 0.5  # time for the error responses of the open requests to reach their clients
# After the engine died, the orderly shutdown gets this long; then the process exits anyway (exit code 1): a
# wedged core thread or a client that never reads must not keep a dead server up.
ENGINE_DEATH_EXIT_S = 15.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.drain_timeout_s = drain_timeout_s
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self.app.state.async_engine.on_dead = self._engine_died
        await super().serve(sockets)

    def _engine_died(self, reason: str) -> None:
        """The open requests have their errors; let their responses go out, then stop with exit code 1."""
        logger.error("engine died (%s): shutting down", reason)
        self.exit_code = 1
        self._loop.call_later(ENGINE_DEATH_GRACE_S, setattr, self, "should_exit", True)
        backstop = threading.Timer(ENGINE_DEATH_EXIT_S, _exit_now, (1,))
        backstop.daemon = True
        backstop.start()

    def handle_exit(self, sig: int, frame) -> None:
        # Runs in the main thread from the signal handler. The first signal starts a drain on the loop (the
        # listener stays open so new requests get a clean 503); a second one exits at once.
        if self._draining or self._loop is None or not self.started:
            self.should_exit = True
            self.force_exit = self._draining
            return
        self._draining = True
        timeout_s = self.drain_timeout_s if sig == signal.SIGTERM else 0.0
        logger.info("received %s: draining (timeout %.0fs)", signal.Signals(sig).name, timeout_s)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit(timeout_s)))

    async def _drain_then_exit(self, timeout_s: float) -> None:
        try:
            await drain(self.app, timeout_s)
        finally:
            self.should_exit = True


def _exit_now(code: int) -> None:
    logger.error("the shutdown after the engine died did not finish in %.0fs: exiting now", ENGINE_DEATH_EXIT_S)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)
