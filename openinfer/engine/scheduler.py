"""Continuous-batching scheduler. Pure Python: it decides, per step, how many tokens each request computes.

There is no prefill phase and no decode phase: every request's ``num_computed_tokens`` catches up to its
``num_tokens`` under a token budget (chunked prefill falls out of the budget, prefix-cache hits start the count
higher, preemption resets it to zero and the request recomputes). Running requests are served first in FCFS
order; when blocks run out, the most recently admitted running request is preempted.
"""
from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from openinfer.engine.core_io import EngineCoreOutput
from openinfer.engine.kv_cache_manager import KVCacheManager
from openinfer.engine.request import Request, RequestStatus
from openinfer.step_io import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput

if TYPE_CHECKING:  # the scheduler stays importable without torch
    from openinfer.config import SchedulerConfig


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Ended or preempted since the last schedule(): the workers drop their state for these.
        self._finished_ids: list[str] = []

    # -- intake ------------------------------------------------------------------------------------------
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
        self._finished_ids.append(req.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- the step ----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        new_reqs: list[Request] = []
        cached: list[tuple[Request, list[list[int]]]] = []

        # 1) running requests, FCFS
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while (blocks := self.kv.allocate_slots(req, num_new)) is None:
                # Newest admitted goes first. Requests are visited in order, so the tail was not scheduled yet
                # this step (or it is ``req`` itself).
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is req:
                    num_new = 0
                    break
            if num_new == 0:
                break
            cached.append((req, blocks.block_ids()))
            out.num_scheduled_tokens[req.request_id] = num_new
            budget -= num_new
            i += 1

        # 2) waiting requests, in order, while the budget, the seat count and the blocks allow
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if out.preempted_req_ids:
                break  # memory is short this step; admitting more would only thrash
            req = self.waiting[0]
            hit, num_hit = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else (None, 0)
            num_new = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
            if self.kv.allocate_slots(req, num_new, hit) is None:
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.times.first_scheduled_s is None:
                req.times.first_scheduled_s = time.monotonic()
            req.num_computed_tokens += num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            new_reqs.append(req)
            out.num_scheduled_tokens[req.request_id] = num_new
            budget -= num_new

        out.new_requests = [NewRequestData(r.request_id, r.prompt_token_ids, r.sampling_params,
                                           self.kv.block_ids(r.request_id), r.num_computed_tokens,
                                           list(r.output_token_ids)) for r in new_reqs]
        out.cached_requests = [CachedRequestData(r.request_id, ids, r.num_computed_tokens) for r, ids in cached]
        out.finished_req_ids, self._finished_ids = self._finished_ids, []
        return out

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: drop the KV, keep the tokens, go back to the front of the queue."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._finished_ids.append(req.request_id)

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or preempted meanwhile
            req.num_computed_tokens += n
            self.kv.release_stale_blocks(req)
            prompt_lp = result.prompt_logprobs.get(rid)
            sampled = result.sampled.get(rid)
            if sampled is None:
                if prompt_lp:
                    outputs.append(self._output(req, [], None, prompt_lp, None, now))
                continue
            req.append_output_token(sampled.token_id)
            if req.times.first_token_s is None:
                req.times.first_token_s = now
            status = self._check_stop(req, sampled.token_id)
            lp = None
            if req.sampling_params.logprobs is not None:
                lp = [sampled.top_logprobs or {sampled.token_id: sampled.logprob}]
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            outputs.append(self._output(req, [sampled.token_id], lp, prompt_lp, status, now))
        return outputs

    @staticmethod
    def _output(req: Request, tokens: list[int], lp, prompt_lp, status: RequestStatus | None,
                now: float) -> EngineCoreOutput:
        return EngineCoreOutput(
            req.request_id, tokens, lp, prompt_lp, status.finish_reason if status else None,
            req.stop_reason if status else None, max(req.num_cached_tokens, 0), req.num_preemptions,
            req.times.first_scheduled_s, now)

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
