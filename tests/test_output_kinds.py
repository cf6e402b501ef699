"""RequestOutputKind: DELTA outputs add up to the FINAL_ONLY one and to the last CUMULATIVE one (tokens, text with
stop strings held back, logprobs, n > 1), FINAL_ONLY returns one output per request, and what crosses the
engine <-> worker seam is plain msgpack-able data."""
from __future__ import annotations

import msgspec

from openinfer import LLM, SamplingParams
from openinfer.assets_path import toy_model_path
from openinfer.sampling_params import RequestOutputKind
from openinfer.step_io import ModelRunnerOutput, SchedulerOutput


def _drive(llm: LLM, kind: RequestOutputKind, stop: list[str]):
    eng = llm.engine
    sp = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=24, logprobs=1, stop=stop, output_kind=kind)
    eng.add_request("r", "The list object", sp)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == "r"]
    return outs


def test_deltas_add_up_to_the_final_and_cumulative_outputs():
    llm = LLM(model=toy_model_path(), max_num_seqs=4, seed=0)
    final = _drive(llm, RequestOutputKind.FINAL_ONLY, ["e "])
    assert len(final) == 1 and final[0].finished
    assert {c.finish_reason for c in final[0].outputs} & {"stop"}  # the stop string is exercised
    cumulative = _drive(llm, RequestOutputKind.CUMULATIVE, ["e "])
    assert cumulative[-1].finished and len(cumulative) > 1
    deltas = _drive(llm, RequestOutputKind.DELTA, ["e "])
    assert deltas[-1].finished and len(deltas) > 1
    for want in (final[0], cumulative[-1]):
        for c in want.outputs:
            parts = [d for o in deltas for d in o.outputs if d.index == c.index]
            assert [t for d in parts for t in d.token_ids] == c.token_ids
            assert "".join(d.text for d in parts) == c.text
            assert [lp for d in parts for lp in d.logprobs] == c.logprobs
            assert parts[-1].finish_reason == c.finish_reason and parts[-1].cumulative_logprob == c.cumulative_logprob
            assert sum(d.finish_reason is not None for d in parts) == 1  # the finish is reported once
            assert "e " not in c.text
    # cumulative outputs only grow
    for a, b in zip(cumulative, cumulative[1:]):
        for ca in a.outputs:
            cb = b.outputs[ca.index]
            assert cb.token_ids[:len(ca.token_ids)] == ca.token_ids and cb.text.startswith(ca.text)


def test_scheduler_and_runner_messages_round_trip_through_msgpack():
    llm = LLM(model=toy_model_path(), max_num_seqs=4)
    core = llm.engine.core
    llm.engine.add_request("a", "The list object", SamplingParams(max_tokens=3, presence_penalty=0.5))
    llm.engine.add_request("b", "A dict", SamplingParams(max_tokens=3))
    seen = 0
    while core.has_unfinished_requests():
        sched = core.scheduler.schedule()
        wire = msgspec.msgpack.encode(sched)
        back = msgspec.msgpack.decode(wire, type=SchedulerOutput)
        assert back == sched
        result = core.executor.execute_model([back])[0]  # the worker runs from the decoded copy
        back_result = msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=ModelRunnerOutput)
        assert back_result == result
        core.scheduler.update_from_output(sched, back_result)
        seen += 1
    assert seen >= 3 and core.kv.all_free()
