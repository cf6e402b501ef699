"""Honest health: what ``/health`` (liveness) and ``/health/ready`` (readiness) answer, and the watchdog that
ends a wedged engine.

* Readiness fails while requests are not succeeding: after ``ready_max_step_failures`` engine steps in a row
  whose forward raised (until one succeeds again), while a step runs past the stall bound, while draining, and
  when the engine is gone. A not-ready server still takes requests sent to it: one that succeeds makes it ready
  again.
* Liveness fails when the engine is dead or wedged: a step running past ``step_timeout_s``. The watchdog then
  ends every open request with an error and the engine is marked dead, which exits the process with a non-zero
  code (``server/runner.py``) so a supervisor restarts it. A thread stuck in a step cannot be stopped from Python
  (no thread kill; a hung kernel or collective may never return), so exiting is the only honest way out.
* ``request_timeout_s``: a request running longer is aborted (its blocks go back to the pool) and answered 504,
  or an error event when streaming.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this module to build its parser: keep that light
    from openinfer.server.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

READY_STALL_S = 60.0  # a step running longer than this (or than step_timeout_s, if lower) makes readiness fail
MAX_TICK_S = 0.25  # the watchdog's period at most: how late past its bound it acts


@dataclass(frozen=True)
class HealthSettings:
    ready_max_step_failures: int = 3
    step_timeout_s: float | None = 300.0  # None: no watchdog
    request_timeout_s: float | None = None  # None: requests may run as long as they need

    def __post_init__(self) -> None:
        if self.ready_max_step_failures < 1:
            raise ValueError(f"--ready-max-step-failures must be >= 1, got {self.ready_max_step_failures}")
        for name in ("step_timeout_s", "request_timeout_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 (or 0 for none), got {v}")

    @property
    def stall_s(self) -> float:
        return min(READY_STALL_S, self.step_timeout_s or READY_STALL_S)

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("health")
        g.add_argument("--ready-max-step-failures", type=int, default=HealthSettings.ready_max_step_failures,
                       help="engine steps failing in a row before /health/ready answers 503 (until one succeeds)")
        g.add_argument("--step-timeout-s", type=float, default=HealthSettings.step_timeout_s,
                       help="a step running longer fails /health, ends every open request with an error and "
                            "exits the process with code 1 for a supervisor to restart (0 = no watchdog; raise it "
                            "where one prefill step can take minutes, e.g. a large model on CPU)")
        g.add_argument("--request-timeout-s", type=float, default=0.0,
                       help="a request running longer is aborted and answered 504 (0 = no limit, the default)")

    @staticmethod
    def from_cli_args(args: argparse.Namespace) -> HealthSettings:
        return HealthSettings(args.ready_max_step_failures, args.step_timeout_s or None,
                              args.request_timeout_s or None)


def liveness_problem(engine: AsyncEngine, settings: HealthSettings, now: float) -> str | None:
    if not engine.alive:
        return engine.dead_reason or "engine stopped"
    started = engine.stats.step_started_s
    if settings.step_timeout_s is not None and started is not None and now - started > settings.step_timeout_s:
        return f"an engine step has been running for {now - started:.1f}s (step timeout {settings.step_timeout_s:g}s)"
    return None


def readiness_problem(engine: AsyncEngine, settings: HealthSettings, now: float) -> str | None:
    problem = liveness_problem(engine, settings, now)
    if problem is not None:
        return problem
    s = engine.stats
    if engine.draining:
        return "draining for shutdown"
    if s.consecutive_failed_steps >= settings.ready_max_step_failures:
        return f"the last {s.consecutive_failed_steps} engine steps failed"
    if s.step_started_s is not None and now - s.step_started_s > settings.stall_s:
        return f"an engine step has been running for {now - s.step_started_s:.0f}s"
    if s.step_started_s is None and now - s.heartbeat_s > settings.stall_s:
        return f"the engine loop has not iterated for {now - s.heartbeat_s:.0f}s"
    return None


class Watchdog:
    """A task on the event loop (which a stuck core thread does not block): ends a wedged engine, and aborts
    requests past their timeout."""

    def __init__(self, engine: AsyncEngine, settings: HealthSettings) -> None:
        self.engine = engine
        self.settings = settings
        bounds = [b for b in (settings.step_timeout_s, settings.request_timeout_s) if b is not None]
        self.tick_s = min([MAX_TICK_S] + [b / 4 for b in bounds])
        self._task: asyncio.Task | None = None

    @property
    def needed(self) -> bool:
        return self.settings.step_timeout_s is not None or self.settings.request_timeout_s is not None

    def start(self) -> None:
        if self.needed:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="health-watchdog")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while self.engine.dead_reason is None:
            await asyncio.sleep(self.tick_s)
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        eng, st = self.engine, self.settings
        if eng.dead_reason is not None:
            return
        started = eng.stats.step_started_s
        if st.step_timeout_s is not None and started is not None and now - started > st.step_timeout_s:
            reason = (f"engine step wedged: running for {now - started:.1f}s, past the step timeout of "
                      f"{st.step_timeout_s:g}s; the server exits for its supervisor to restart it")
            logger.error(reason)
            eng.wedged(reason)
            return
        if st.request_timeout_s is not None:
            n = eng.expire(now, st.request_timeout_s)
            if n:
                logger.warning("aborted %d requests past the request timeout of %gs", n, st.request_timeout_s)
