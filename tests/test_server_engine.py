"""The engine-core bridge without HTTP: typed messages, diffs that add up to the offline outputs, abort frees
KV blocks, bounded admission, and a dying core that fails every request instead of hanging it."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from server_utils import shared_checkpoint

from openinfer import LLM, SamplingParams
from openinfer.server.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable, RequestStream
from openinfer.server.messages import (
    AbortRequests,
    AddRequest,
    CompletionDelta,
    Control,
    EngineCommand,
    EngineEvent,
    RequestUpdate,
    Shutdown,
    StatsSnapshot,
)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(
        str(shared_checkpoint(tmp_path_factory)),
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=128,
        max_num_seqs=4,
    )


def test_messages_are_schemad_and_roundtrip():
    params = SamplingParams(n=2, temperature=0.5, seed=3, stop=["ab"], logprobs=2, max_tokens=7)
    cmds = [
        AddRequest("r1", [1, 2, 3], params, "hi", 12.5),
        AbortRequests(["r1"]),
        Control(4, "reset_prefix_cache"),
        Shutdown(),
    ]
    for codec in (msgspec.msgpack, msgspec.json):
        wire = [codec.encode(c) for c in cmds]
        assert [codec.decode(w, type=EngineCommand) for w in wire] == cmds
    update = RequestUpdate(
        "r1",
        [CompletionDelta(0, "x", [5], [{5: -0.1, 7: -2.0}], "stop", "ab")],
        finished=True,
        num_prompt_tokens=3,
        num_cached_tokens=0,
        prompt_logprobs=[None, {2: -1.0}],
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(update), type=EngineEvent) == update
    assert (
        msgspec.json.decode(msgspec.json.encode(StatsSnapshot(num_blocks=8)), type=StatsSnapshot).num_blocks
        == 8
    )
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"type": "AbortRequests", "request_ids": "r1"}', type=EngineCommand)


async def _drain(stream: RequestStream) -> list[RequestUpdate]:
    out = []
    while not stream.done:
        out.append(await asyncio.wait_for(stream.get(), 30))
    return out


def _run(coro):
    return asyncio.run(coro)


def test_diffs_add_up_to_offline_and_abort_frees(llm):
    engine = llm.engine
    prompts = ["diff one", "second prompt", "x"]
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=9, ignore_eos=True, logprobs=1, n=2)
    want = llm.generate(prompts, params, use_tqdm=False)

    async def main():
        ae = AsyncEngine(engine, max_queue=4)
        ae.start()
        try:
            adds = [AddRequest(f"d{i}", engine.tokenizer.encode(p), params, p) for i, p in enumerate(prompts)]
            with pytest.raises(EngineOverloaded):  # 4 seats + 4 queued < 6 + 4 sequences
                ae.submit(adds + [AddRequest("big", [5], params.clone(n=4))])
            updates = await _drain(ae.submit(adds))
            long = ae.submit([AddRequest("long", [5, 6], SamplingParams(max_tokens=200, ignore_eos=True))])
            first = await long.get()
            assert first.accepted
            while not (await long.get()).outputs:
                pass
            long.abort()
            rest = await _drain(long)
            await asyncio.sleep(0.1)
            return updates, rest, ae.stats, ae.num_in_flight
        finally:
            await ae.stop()

    updates, rest, stats, in_flight = _run(main())
    for i, out in enumerate(want):
        mine = [u for u in updates if u.request_id == f"d{i}"]
        assert mine[0].accepted and mine[-1].finished
        for c in out.outputs:
            deltas = [d for u in mine for d in u.outputs if d.index == c.index]
            assert "".join(d.text for d in deltas) == c.text
            assert [t for d in deltas for t in d.token_ids] == c.token_ids
            got = [lp for d in deltas for lp in d.logprobs]
            assert [sorted(g) for g in got] == [sorted(w) for w in c.logprobs]
            assert [v for g in got for _, v in sorted(g.items())] == pytest.approx(
                [v for w in c.logprobs for _, v in sorted(w.items())], abs=1e-4
            )
            assert deltas[-1].finish_reason == "length"
    assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"
    assert stats.num_free_blocks == stats.num_blocks and in_flight == 0


def test_dead_core_fails_requests_instead_of_hanging(llm, monkeypatch):
    engine = llm.engine

    def boom():
        raise RuntimeError("simulated core bug")

    async def main():
        ae = AsyncEngine(engine, max_queue=4)
        ae.start()
        try:
            monkeypatch.setattr(engine, "step", boom)
            s = ae.submit([AddRequest("dead", [5, 6], SamplingParams(max_tokens=4))])
            updates = await _drain(s)
            with pytest.raises(EngineUnavailable):
                ae.submit([AddRequest("after", [5], SamplingParams(max_tokens=1))])
            with pytest.raises(EngineUnavailable):
                await ae.control("reset_prefix_cache")
            return updates, ae.alive, ae.num_in_flight
        finally:
            await ae.stop()

    updates, alive, in_flight = _run(main())
    assert (
        updates[-1].finished
        and updates[-1].error_kind == "engine"
        and "simulated core bug" in updates[-1].error
    )
    assert not alive and in_flight == 0
    monkeypatch.undo()
    engine.abort_request(["dead"])  # leave the shared engine clean for other tests
