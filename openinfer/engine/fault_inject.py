"""Fault injection FOR TESTS ONLY: the server's health tests make the engine fail on purpose through
``OPENINFER_FAULT_INJECT`` and check what clients, probes and supervisors then see. Unset (always, in production)
it is inert: ``from_env()`` returns None and the engine core never calls in here.

    forward_raises[:K]  every forward raises (the first K only, when K is given; then they succeed again)
    step_hangs[:K]      a step with work never returns (a wedged kernel or collective): the first, or the one
                        after K steps with work (so streams are already running)
    engine_dies[:K]     a step with work raises out of the engine loop (a bug in the core): likewise
    slow_steps:S        every step with work sleeps S seconds first (long requests for timeout tests)

Faults fire only on steps that schedule work, so start-up (the executor's warm-up) and an idle server are
untouched.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from openinfer import envs

ENV = envs.variable("FAULT_INJECT")
KINDS = ("forward_raises", "step_hangs", "engine_dies", "slow_steps")


class InjectedFault(RuntimeError):
    """Raised by an injected fault (never in production)."""


@dataclass
class Fault:
    kind: str
    arg: float | None = None  # forward_raises: how many raise (None = all); slow_steps: seconds; else: K
    fired: int = 0
    steps: int = 0  # steps with work seen so far

    def before_step(self) -> None:
        """Called on a step that has work, before the forward's error handling: a fault here escapes the step."""
        self.steps += 1
        if self.kind in ("step_hangs", "engine_dies") and self.steps <= (self.arg or 0):
            return
        if self.kind == "step_hangs":
            threading.Event().wait()  # forever; a Python-level wait, so the GIL stays free for the server
        elif self.kind == "engine_dies":
            raise InjectedFault("injected fault: engine_dies")
        elif self.kind == "slow_steps":
            time.sleep(self.arg or 0.0)

    def before_forward(self) -> None:
        """Called inside the forward's error handling: a fault here fails the step's requests, not the engine."""
        if self.kind == "forward_raises" and (self.arg is None or self.fired < self.arg):
            self.fired += 1
            raise InjectedFault(f"injected fault: forward_raises (#{self.fired})")


def parse(spec: str) -> Fault:
    kind, _, arg = spec.strip().partition(":")
    if kind not in KINDS:
        raise ValueError(f"{ENV}={spec!r}: unknown fault {kind!r} (known: {', '.join(KINDS)})")
    if kind == "slow_steps" and not arg:
        raise ValueError(f"{ENV}={spec!r}: slow_steps needs seconds, e.g. slow_steps:0.05")
    try:
        value = float(arg) if arg else None
    except ValueError:
        raise ValueError(f"{ENV}={spec!r}: {arg!r} is not a number") from None
    if value is not None and value < 0:
        raise ValueError(f"{ENV}={spec!r}: the argument must be >= 0")
    return Fault(kind, value)


def from_env() -> Fault | None:
    spec = envs.FAULT_INJECT
    return parse(spec) if spec else None
