"""The NIXL agents' progress thread sleeps between polls (nixl_agent.py): nixl's wrapper builds agents with a zero
delay, a core each spent polling, which starved the ranks on small hosts."""
from __future__ import annotations

import pytest


def test_agents_are_built_with_a_progress_delay_and_the_wrapper_is_left_as_it_was():
    _api = pytest.importorskip("nixl._api")
    from openinfer.distributed.kv_transfer.nixl_agent import PROGRESS_DELAY_US, make_agent

    native = _api.nixlBind.nixlAgent
    seen = []

    def spy(name, config):
        seen.append((name, config.pthrDelay, config.useProgThread))
        return native(name, config)

    _api.nixlBind.nixlAgent = spy
    try:
        agent = make_agent("delay-test", ["UCX"], progress_delay_us=2500)
        assert seen == [("delay-test", 2500, True)]  # the thread kept, sleeping 2.5 ms when idle
        assert _api.nixlBind.nixlAgent is spy  # what was there before is put back
        assert agent.get_agent_metadata()
    finally:
        _api.nixlBind.nixlAgent = native
    assert PROGRESS_DELAY_US > 0
