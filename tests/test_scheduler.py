"""Scheduler: continuous batching, chunked prefill, budgets, preemption, abort. No torch."""
from __future__ import annotations

from dataclasses import dataclass

from openinfer.config import SchedulerConfig
from openinfer.engine.kv_cache_manager import KVCacheManager
from openinfer.engine.request import Request, RequestStatus
from openinfer.engine.scheduler import Scheduler
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.sampling_params import SamplingParams
from openinfer.step_io import ModelRunnerOutput, SampledToken, SchedulerOutput

BS = 4


def make(num_blocks=16, max_num_seqs=8, budget=64, caching=True):
    kv = KVCacheManager([KVGroupSpec("full", 64)], {"full": num_blocks}, BS, caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget), kv), kv


@dataclass
class Seq:
    """One scheduled request as a worker sees it: its tokens this step and whether it samples."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    sample: bool


def seqs(s: Scheduler, out: SchedulerOutput) -> list[Seq]:
    """Read before update_from_output: where each scheduled request starts and what it computes."""
    starts = {r.req_id: r.num_computed_tokens for r in out.new_requests + out.cached_requests}
    result = []
    for rid, n in out.num_scheduled_tokens.items():
        req, start = s.requests[rid], starts[rid]
        result.append(Seq(rid, req.all_token_ids[start:start + n], start, start + n == req.num_tokens))
    return result


def add(s: Scheduler, rid: str, n_prompt: int, max_tokens: int = 4, base: int = 0, **sp) -> Request:
    r = Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                          **sp), 128)
    s.add_request(r)
    return r


class Step:
    """A SchedulerOutput plus the per-request view ``seqs`` (read before the update)."""

    def __init__(self, s: Scheduler, out: SchedulerOutput) -> None:
        self.out = out
        self.seqs = seqs(s, out)

    def __getattr__(self, name):
        return getattr(self.out, name)


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    step = Step(s, out)
    result = ModelRunnerOutput({q.request_id: [SampledToken(token)] for q in step.seqs if q.sample})
    return step, s.update_from_output(out, result)


def test_prefill_then_decode_is_one_rule():
    s, kv = make()
    add(s, "a", 6, max_tokens=3)
    out, res = run_step(s)
    assert [(q.request_id, len(q.token_ids), q.start_pos, q.sample) for q in out.seqs] == [("a", 6, 0, True)]
    assert res[0].new_token_ids == [7]
    out, res = run_step(s)
    assert [(len(q.token_ids), q.start_pos, q.token_ids) for q in out.seqs] == [(1, 6, [7])]
    out, res = run_step(s)
    assert res[0].finish_reason == "length"
    assert s.num_unfinished == 0 and kv.groups[0].pool.num_free_blocks == 16


def test_chunked_prefill_under_token_budget_and_fcfs():
    s, kv = make(budget=5)
    add(s, "a", 12)
    add(s, "b", 3, base=100)
    out, _ = run_step(s)
    assert [(q.request_id, len(q.token_ids), q.sample) for q in out.seqs] == [("a", 5, False)]
    out, _ = run_step(s)
    assert [(q.request_id, len(q.token_ids), q.start_pos) for q in out.seqs] == [("a", 5, 5)]
    out, _ = run_step(s)  # a finishes its prompt (2) and samples; b gets the remaining budget 3
    assert [(q.request_id, len(q.token_ids), q.sample) for q in out.seqs] == [("a", 2, True), ("b", 3, True)]
    assert out.total_num_scheduled_tokens == 5


def test_max_num_seqs_caps_running():
    s, _ = make(max_num_seqs=2)
    for i in range(3):
        add(s, f"r{i}", 2, base=10 * i)
    out, _ = run_step(s)
    assert [q.request_id for q in out.seqs] == ["r0", "r1"]
    assert len(s.waiting) == 1


def test_preemption_by_recompute_keeps_order_and_tokens():
    # 4 blocks of 4 tokens. Two requests of 7 prompt tokens take 2 blocks each; decoding needs a third.
    s, kv = make(num_blocks=4)
    a = add(s, "a", 7, max_tokens=6)
    b = add(s, "b", 7, max_tokens=6, base=50)
    run_step(s)  # prompts: 2 blocks each, pool full
    assert kv.groups[0].pool.num_free_blocks == 0
    run_step(s)  # position 7 still fits in each second block
    out, _ = run_step(s)  # a needs a block for position 8: b (newest) is preempted
    assert out.preempted_req_ids == ["b"] and [q.request_id for q in out.seqs] == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [7, 7] and s.waiting[0] is b
    while s.num_unfinished:
        run_step(s)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert b.num_preemptions >= 1 and kv.groups[0].pool.num_free_blocks == 4
    assert all(blk.ref_cnt == 0 for blk in kv.groups[0].pool.blocks)


def test_recompute_after_preemption_covers_prompt_and_outputs():
    s, kv = make(num_blocks=4, caching=False)
    add(s, "a", 7, max_tokens=6)
    add(s, "b", 7, max_tokens=6, base=50)
    for _ in range(3):
        run_step(s)  # b is preempted in the third step holding two output tokens
    seen = []
    while s.num_unfinished:
        out, _ = run_step(s)
        seen += [(q.start_pos, len(q.token_ids)) for q in out.seqs if q.request_id == "b"]
    assert seen[0] == (0, 9)  # 7 prompt + 2 generated tokens recomputed in one go


def test_abort_frees_blocks_in_waiting_and_running():
    s, kv = make()
    add(s, "a", 9)
    add(s, "b", 9, base=40)
    run_step(s)
    add(s, "c", 5, base=80)
    done = s.finish_requests(["a", "c", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["a", "c"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in done)
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert s.num_unfinished == 0 and kv.groups[0].pool.num_free_blocks == 16


def test_prefix_hit_skips_computation_and_is_reported():
    s, kv = make()
    add(s, "a", 10, max_tokens=1)
    run_step(s)
    r = add(s, "b", 10, max_tokens=1)
    out, res = run_step(s)
    assert [(q.start_pos, len(q.token_ids)) for q in out.seqs] == [(8, 2)]
    assert r.num_cached_tokens == 8 and res[0].num_cached_tokens == 8


def test_stop_token_and_eos_and_min_tokens():
    s, _ = make()
    r = Request("a", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[7], min_tokens=2), 128)
    s.add_request(r)
    _, res = run_step(s)  # token 7 before min_tokens: not a stop
    assert res[0].finish_reason is None
    _, res = run_step(s)
    assert res[0].finish_reason == "stop" and res[0].stop_reason == 7
    r2 = Request("b", [1, 2], SamplingParams(max_tokens=10, eos_token_ids=frozenset({7})), 128)
    s.add_request(r2)
    _, res = run_step(s)
    assert res[0].finish_reason == "stop" and res[0].stop_reason is None


def test_max_model_len_ends_generation():
    s, _ = make()
    r = Request("a", [1] * 6, SamplingParams(max_tokens=None, ignore_eos=True), 8)
    s.add_request(r)
    while s.num_unfinished:
        _, res = run_step(s)
    assert r.num_tokens == 8 and res[0].finish_reason == "length"
