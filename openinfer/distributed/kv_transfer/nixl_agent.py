"""A NIXL agent whose progress thread sleeps between polls.

nixl's Python wrapper (``nixl._api.nixl_agent``, 1.5) builds its agent with ``pthrDelay = 0``: the progress thread
polls UCX without pause and holds a whole core per agent even when nothing moves. An instance has one agent per rank,
so a host running a prefill and a decode instance of two ranks each spends four cores on idle polling - on a 2-core
machine that starves the ranks themselves (measured: one idle agent 100 % of a core at delay 0, 2 % at 1 ms).

The wrapper offers no setting for it, so the one call that builds the native agent is wrapped while the wrapper runs,
setting the delay on the config it passes. The thread itself is kept: without it a transfer only advances while its
owner polls, and an idle producer would never complete a read or see a release.
"""
from __future__ import annotations

import threading

# How long the progress thread sleeps when a poll found nothing to do. Transfers are checked by the engine between
# steps (milliseconds apart), so a 1 ms pause costs no latency a step would notice.
PROGRESS_DELAY_US = 1000

_lock = threading.Lock()


def make_agent(name: str, backends: list[str], progress_delay_us: int = PROGRESS_DELAY_US):
    from nixl import _api

    native = _api.nixlBind.nixlAgent

    def build(agent_name, config):
        config.pthrDelay = progress_delay_us
        return native(agent_name, config)

    with _lock:  # the wrapper reads the module attribute once, inside its constructor
        _api.nixlBind.nixlAgent = build
        try:
            return _api.nixl_agent(name, _api.nixl_agent_config(backends=backends))
        finally:
            _api.nixlBind.nixlAgent = native
