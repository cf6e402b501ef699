"""Continuous-batching scheduler. Pure Python: it decides, per step, how many tokens each request computes.

There is no prefill phase and no decode phase: every request's ``num_computed_tokens`` catches up to its
``num_tokens`` under a token budget (chunked prefill falls out of the budget, prefix-cache hits start the
count higher, preemption resets it to zero and the request recomputes). Running requests are served first in
FCFS order; when blocks run out, the most recently admitted running request is preempted.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from openinfer.engine.kv_cache_manager import KVCacheManager
from openinfer.engine.request import Request, RequestStatus
from openinfer.sampling_params import SamplingParams

if TYPE_CHECKING:  # the scheduler stays importable without torch
    from openinfer.config import SchedulerConfig


@dataclass
class ScheduledSeq:
    """What the model runner needs for one request this step: plain ids and counts."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # num_computed_tokens before this step (position of token_ids[0])
    block_ids: list[int]
    sample: bool  # this step reaches num_tokens: sample one new token
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_prompt_tokens: int
    # The window group's table (hybrid models, see hybrid_kv_cache_manager); None for one-group models.
    window_block_ids: list[int] | None = None
    coarse_block_ids: list[int] | None = None  # the coarse group's table, likewise


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.seqs


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None  # token id -> logprob (includes the sampled token)


@dataclass
class RunnerOutput:
    """What the model runner hands back: one sampled token per sampling request, plus prompt logprobs."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    new_prompt_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- intake ----------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Abort or stop requests from outside the step (client gone, stop string hit)."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.times.finished_s = time.monotonic()
        self.kv.free(req)
        del self.requests[req.request_id]

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- the step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        # 1) running requests, FCFS
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while self.kv.allocate_slots(req, num_new) is None:
                # Newest admitted goes first. Requests are visited in order, so the tail was not scheduled
                # yet this step (or it is ``req`` itself).
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is req:
                    num_new = 0
                    break
            if num_new == 0:
                break
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1

        # 2) waiting requests, in order, while the budget, the seat count and the blocks allow
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if out.preempted_ids:
                break  # memory is short this step; admitting more would only thrash
            req = self.waiting[0]
            hits, num_hit = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else ([], 0)
            num_new = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.times.first_scheduled_s is None:
                req.times.first_scheduled_s = time.monotonic()
            req.num_computed_tokens += num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new

        for req, n in scheduled:
            start = req.num_computed_tokens
            out.seqs.append(ScheduledSeq(
                request_id=req.request_id,
                token_ids=req.all_token_ids[start:start + n],
                start_pos=start,
                block_ids=self.kv.block_ids(req.request_id),
                sample=start + n == req.num_tokens,
                sampling_params=req.sampling_params,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids,
                num_prompt_tokens=req.num_prompt_tokens,
                window_block_ids=self.kv.window_block_ids(req.request_id),
                coarse_block_ids=self.kv.coarse_block_ids(req.request_id),
            ))
            out.num_batched_tokens += n
        return out

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: drop the KV, keep the tokens, go back to the front of the queue."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        for seq in sched.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or preempted meanwhile
            req.num_computed_tokens += len(seq.token_ids)
            self.kv.release_stale_blocks(req)
            prompt_lp = result.prompt_logprobs.get(seq.request_id)
            sampled = result.sampled.get(seq.request_id)
            if sampled is None:
                if prompt_lp:
                    outputs.append(EngineCoreOutput(req.request_id, [], None, prompt_lp, None, None,
                                                    req.num_cached_tokens))
                continue
            req.append_output_token(sampled.token_id)
            if req.times.first_token_s is None:
                req.times.first_token_s = now
            req.times.last_token_s = now
            status = self._check_stop(req, sampled.token_id)
            lp = None
            if req.sampling_params.logprobs is not None:
                lp = [sampled.top_logprobs or {sampled.token_id: sampled.logprob}]
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            outputs.append(EngineCoreOutput(
                req.request_id, [sampled.token_id], lp, prompt_lp,
                status.finish_reason if status else None, req.stop_reason, req.num_cached_tokens,
            ))
        return outputs

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token_id in sp.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in sp.stop_token_ids:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens:  # max_tokens is capped by max_model_len (Request)
            return RequestStatus.FINISHED_LENGTH
        return None
