"""vLLM's priority scheduling (``--scheduling-policy priority``, ``priority`` on requests): a lower value is admitted
first, ties by arrival; when blocks run out the lowest priority running request is preempted; a waiting request
never preempts to get in. The scheduler alone (no torch), then the whole engine on a tiny checkpoint."""
from __future__ import annotations

import pytest
from test_scheduler import run_step

from openinfer.config import SchedulerConfig
from openinfer.engine.kv_cache_manager import KVCacheManager
from openinfer.engine.request import RequestStatus
from openinfer.engine.scheduler import Scheduler
from openinfer.kv_cache_interface import KVGroupSpec

BS = 4


def make(policy: str, num_blocks: int = 16, max_num_seqs: int = 8):
    kv = KVCacheManager([KVGroupSpec("full", 64)], {"full": num_blocks}, BS, True)
    return Scheduler(SchedulerConfig(max_num_seqs, 64, policy=policy), kv)


def queued(s: Scheduler, rid: str, prio: int, n_prompt: int = 3, max_tokens: int = 2, base: int = 0):
    from openinfer.engine.request import Request
    from openinfer.sampling_params import SamplingParams

    r = Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                128, arrival_s=None, priority=prio)
    s.add_request(r)
    return r


def drain(s: Scheduler) -> list[str]:
    order = []
    while s.num_unfinished:
        out, _ = run_step(s)
        order += [r.req_id for r in out.new_requests]
    return order


@pytest.mark.parametrize("policy, expected", [("priority", ["d", "b", "c", "a"]), ("fcfs", ["a", "b", "c", "d"])])
def test_full_queue_admits_by_priority_then_arrival(policy, expected):
    s = make(policy, max_num_seqs=1)
    queued(s, "x", 0)
    run_step(s)  # x holds the only seat: the rest wait in a full queue
    assert [r.request_id for r in s.running] == ["x"]
    for rid, prio in (("a", 5), ("b", 1), ("c", 1), ("d", 0)):
        queued(s, rid, prio if policy == "priority" else 0, base=10 * prio)
    assert drain(s) == expected


def test_a_waiting_request_does_not_preempt_a_running_one():
    s = make("priority", max_num_seqs=1)
    x = queued(s, "x", 9, max_tokens=4)
    run_step(s)
    queued(s, "urgent", -5)
    out, _ = run_step(s)
    assert out.preempted_req_ids == [] and x.status == RequestStatus.RUNNING
    assert drain(s) == ["urgent"]  # admitted once x ends


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "high")])
def test_preemption_takes_the_lowest_priority(policy, victim):
    # 4 blocks of 4 tokens; two prompts of 7 tokens take 2 blocks each, decoding position 8 needs a third block.
    # "low" arrives first (priority 9), "high" second (priority 0): FCFS preempts the newest ("high"), the
    # priority policy the lowest priority ("low"), as vLLM's max(running, key=(priority, arrival)).
    s = make(policy, num_blocks=4)
    low = queued(s, "low", 9 if policy == "priority" else 0, n_prompt=7, max_tokens=6)
    high = queued(s, "high", 0, n_prompt=7, max_tokens=6, base=50)
    run_step(s)
    run_step(s)
    out, _ = run_step(s)
    assert out.preempted_req_ids == [victim]
    assert {"low": low, "high": high}[victim].status == RequestStatus.PREEMPTED
    while s.num_unfinished:
        run_step(s)
    assert low.num_output_tokens == 6 and high.num_output_tokens == 6


def test_preempted_request_requeues_at_its_priority():
    """Back in the queue a preempted request keeps its (priority, arrival) place: ahead of a later arrival of the
    same priority, behind a waiting request of a better one."""
    s = make("priority", num_blocks=4, max_num_seqs=2)
    queued(s, "a", 1, n_prompt=7, max_tokens=6)
    b = queued(s, "b", 5, n_prompt=7, max_tokens=6, base=50)
    run_step(s)
    run_step(s)
    queued(s, "c", 0, n_prompt=3, max_tokens=1, base=100)  # better than b, arrived after it
    queued(s, "d", 5, n_prompt=3, max_tokens=1, base=110)  # as good as b, arrived after it
    out, _ = run_step(s)
    assert out.preempted_req_ids == ["b"] and b.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in s.waiting] == ["c", "b", "d"]


def test_priority_needs_the_priority_policy():
    from openinfer.engine.request import check_priority

    check_priority(0, "fcfs")
    check_priority(-3, "priority")
    with pytest.raises(ValueError, match="priority=2 needs the priority scheduling policy"):
        check_priority(2, "fcfs")
    with pytest.raises(ValueError, match="priority must be a 64-bit integer"):
        check_priority(True, "priority")
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        SchedulerConfig(policy="lifo")


def test_engine_runs_a_full_queue_in_priority_order(tmp_path):
    """The whole engine, one seat (max_num_seqs=1): LLM.generate(priority=[...]) finishes the requests in
    priority order, ties by their order in the list; under FCFS, priorities other than 0 are refused by name."""
    from helpers import make_dense_checkpoint

    from openinfer import LLM, SamplingParams

    ckpt = make_dense_checkpoint(tmp_path / "m", "llama", vocab_size=256, max_position_embeddings=256)
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128, num_kv_blocks=64, max_num_seqs=1,
              scheduling_policy="priority", kernel_backend="torch")
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    priorities = [3, 1, 3, -1]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, priority=priorities)
    assert [o.prompt_token_ids for o in outs] == prompts  # answers in the caller's order
    started = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert started == [3, 1, 0, 2]
    with pytest.raises(ValueError, match="got 4 prompts but 2 priorities"):
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, priority=[0, 1])

    fcfs = LLM(str(ckpt), dtype="float32", max_model_len=128, num_kv_blocks=64, kernel_backend="torch")
    with pytest.raises(ValueError, match="priority=1 needs the priority scheduling policy"):
        fcfs.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False, priority=[1])
