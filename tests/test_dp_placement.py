"""Data-parallel placement inside one instance (EngineCore._place): the least loaded replica, unless another
replica's prefix cache holds at least half of the prompt and it is not much busier. Real schedulers and KV
managers, no model: the rule is the whole of what is tested here (the DP = 2 engine test in test_tensor_parallel.py
drives it end to end)."""
from __future__ import annotations

from test_scheduler import add, make, run_step

from openinfer.engine.core import EngineCore
from openinfer.engine.request import Request
from openinfer.sampling_params import SamplingParams


def _core(n: int = 2) -> EngineCore:
    core = EngineCore.__new__(EngineCore)  # the placement reads only the replicas' schedulers and caches
    pairs = [make(num_blocks=32) for _ in range(n)]
    core.schedulers, core.kvs = [s for s, _ in pairs], [kv for _, kv in pairs]
    return core


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True), 128)


def _finish(core: EngineCore, replica: int, rid: str, prompt: list[int]) -> None:
    s = core.schedulers[replica]
    s.add_request(_req(rid, prompt))
    while s.num_unfinished:
        run_step(s)


def test_a_cached_prefix_draws_its_continuation_within_the_slack():
    core = _core()
    history = list(range(100, 120))  # 20 tokens: 4 full blocks of 4 cached on replica 1 once it has run
    _finish(core, 1, "turn1", history)
    follow = _req("turn2", history + [7, 8, 9])
    assert [kv.cached_prefix_tokens(follow) for kv in core.kvs] == [0, 20]
    assert core.kvs[1].stats.queries == 20  # the probe counts no query: only turn1's own lookup is in the stats
    assert core._place(follow) == 1  # idle both: the hit wins over the tie-break to replica 0
    for i in range(3):  # replica 1 busier by 3: past the slack of 2, the least loaded one takes it
        add(core.schedulers[1], f"busy{i}", 3, base=500 + 10 * i)
    assert core._place(follow) == 0
    add(core.schedulers[0], "other", 3, base=900)
    assert core._place(follow) == 1  # busier by 2: within the slack


def test_short_hits_and_equal_hits_go_to_the_least_loaded_replica():
    core = _core()
    shared = list(range(100, 108))  # 2 blocks
    _finish(core, 1, "a", shared + [1, 2, 3])
    long_tail = _req("b", shared + list(range(200, 220)))  # 8 of 28 tokens cached: under half
    assert core.kvs[1].cached_prefix_tokens(long_tail) == 8
    add(core.schedulers[1], "x", 3, base=600)
    assert core._place(long_tail) == 0
    _finish(core, 0, "c", shared + [4, 5, 6])  # now both hold the shared blocks
    near = _req("d", shared + [9, 9])
    assert [kv.cached_prefix_tokens(near) for kv in core.kvs] == [8, 8]
    assert core._place(near) == 0  # equal hits: the less loaded replica


def test_no_lookup_when_caching_is_off_or_prompt_logprobs_are_asked():
    core = _core()
    prompt = list(range(100, 120))
    _finish(core, 1, "a", prompt)
    wants_logprobs = Request("b", prompt + [1], SamplingParams(max_tokens=1, prompt_logprobs=1), 128)
    assert core.kvs[1].cached_prefix_tokens(wants_logprobs) == 0
    assert core._place(wants_logprobs) == 0
    s, kv = make(caching=False)
    assert kv.cached_prefix_tokens(_req("c", prompt + [1])) == 0
