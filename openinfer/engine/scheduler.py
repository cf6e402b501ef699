"""Continuous-batching scheduler. Pure Python: it decides, per step, how many tokens each request computes.

There is no prefill phase and no decode phase: every request's ``num_computed_tokens`` catches up to its
``num_tokens`` under a token budget (chunked prefill falls out of the budget, prefix-cache hits start the count
higher, preemption resets it to zero and the request recomputes). Running requests are served first in FCFS
order; when blocks run out, the most recently admitted running request is preempted.

Under the "priority" policy (vLLM's ``--scheduling-policy priority``) both the waiting queue and the running list
are kept in (priority, arrival) order: a lower ``priority`` value is admitted first, ties go by arrival, and the
running request preempted when blocks run out is the lowest priority one (the tail, as vLLM picks
``max(running, key=(priority, arrival))``). As in vLLM, a waiting request never preempts a running one to get in.

With a KV connector (disaggregated prefill/decode, distributed/kv_transfer/): a request whose prompt KV comes from
another instance gets its blocks, then waits in ``waiting_remote`` (WAITING_FOR_REMOTE_KVS) without holding back
the queue; once read it rejoins the front of the queue with all but its last prompt token computed (a failed read:
with none, it computes its prompt here). A request run for a remote decoder keeps its blocks after it ends
(``held``) until the reader is done or the connector's timeout passes. An offloading tier is a connector too: a
waiting request whose prefix past the pool's hit is in the tier is parked the same way while the tier reads it into
fresh blocks, and rejoins with those tokens computed; blocks going back to the pool (a request ended or was
preempted) are offered to it to store. A request whose read is done waits with its blocks until it is scheduled;
such blocks are taken back (the request will look its prefix up again) before any running request is preempted or
when the head of the queue cannot start: waiting requests holding blocks would otherwise wait for each other.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from openinfer.engine.confidence_schedule import drafts_to_verify
from openinfer.engine.core_io import EngineCoreOutput
from openinfer.engine.kv_cache_manager import KVCacheManager
from openinfer.engine.request import INVALID_REQUEST, Request, RequestStatus
from openinfer.engine.spec_stats import SpecDecodeStats
from openinfer.step_io import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput

if TYPE_CHECKING:  # the scheduler stays importable without torch
    from openinfer.config import SchedulerConfig
    from openinfer.distributed.kv_transfer.base import KVConnectorScheduler
    from openinfer.step_io import KVConnectorOutput

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 connector: KVConnectorScheduler | None = None) -> None:
        self.config = config
        self.kv = kv_manager
        self.connector = connector
        self.waiting_remote: dict[str, Request] = {}  # blocks allocated, prompt KV being read from elsewhere
        self.held: dict[str, Request] = {}  # ended, blocks kept for a remote reader
        # Parked request -> (its local prefix hit, the tokens the connector supplies past it).
        self._remote_hit: dict[str, tuple[int, int]] = {}
        # Ended while their read was in flight: the blocks are freed when the worker side reports the read over
        # (done, failed or timed out), never while it may still be writing into them.
        self._orphan_loads: dict[str, Request] = {}
        # Where prompt tokens came from (vLLM's prompt_tokens_by_source) and tokens generated here.
        self.prompt_tokens_computed = 0
        self.prompt_tokens_cached = 0
        self.prompt_tokens_received = 0
        self.generation_tokens = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        # Ended or preempted since the last schedule(): the workers drop their state for these.
        self._finished_ids: list[str] = []
        # Requests ended inside schedule() (a grammar that failed to compile): reported by the next step.
        self._error_outputs: list[EngineCoreOutput] = []
        self._by_priority = config.policy == "priority"
        self._intake = itertools.count()

    # -- intake ------------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        req.arrival_order = next(self._intake)
        if self._by_priority:
            self._insert_sorted(self.waiting, req)
        else:
            self.waiting.append(req)

    @staticmethod
    def _key(req: Request) -> tuple[int, float, int]:
        return req.priority, req.times.arrival_s, req.arrival_order

    def _insert_sorted(self, queue, req: Request) -> None:
        """Into ``queue`` (kept in ``_key`` order) after every request that goes before it or ties with it."""
        queue.insert(bisect.bisect_right(queue, self._key(req), key=self._key), req)

    def _requeue_front(self, reqs: list[Request]) -> None:
        """Requests going back to the queue ahead of new ones (preempted, or their remote read ended): the front
        under FCFS, their (priority, arrival) place under the priority policy."""
        if self._by_priority:
            for req in reqs:
                self._insert_sorted(self.waiting, req)
        else:
            self.waiting.extendleft(reversed(reqs))

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Abort or stop requests from outside the step (client gone, stop string hit)."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.waiting_remote[rid]
                self._remote_hit.pop(rid, None)
                req.status = status
                req.times.finished_s = time.monotonic()
                del self.requests[rid]
                self._orphan_loads[rid] = req
                done.append(req)
                continue
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.times.finished_s = time.monotonic()
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
        if self.connector is not None:
            ok = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
            hold, req.kv_transfer_params = self.connector.request_finished(
                req, req.sampling_params.kv_transfer_params, ok, self.kv.block_ids(req.request_id, placeholder=-1),
                req.times.finished_s)
            if hold:
                self.held[req.request_id] = req
                return
        # A failed step may have left its blocks unwritten: nothing of an errored request is offered for storing.
        self._free_kv(req, offer=status != RequestStatus.FINISHED_ERROR)

    def _free_kv(self, req: Request, offer: bool = True) -> None:
        """Give the request's blocks back to the pool, offering the connector (an offloading tier) its full blocks
        of computed KV first."""
        if offer and self.connector is not None and self.connector.stores_blocks:
            n = min(req.num_computed_tokens, req.num_tokens) // self.kv.block_size
            if n > 0:
                keys = self.kv.full_block_keys(req, n)
                self.connector.blocks_released(req, keys, self.kv.blocks_to_offer(req, keys))
        self.kv.free(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_remote)

    def has_connector_work(self) -> bool:
        """Reads or held prompts in flight: the engine keeps stepping so the worker side is polled."""
        return self.connector is not None and (self.connector.has_pending_work() or bool(self.held)
                                               or bool(self._orphan_loads))

    # -- the KV connector ----------------------------------------------------------------------------------
    def _admit_remote(self, req: Request, hit, num_hit: int) -> bool | None:
        """A waiting request whose prompt KV another instance supplies (past its local prefix hit): allocate its
        blocks and park it until the read ends. True: parked; False: blocks are short (stop admitting); None: not
        a remote request (or its read was tried already)."""
        params = req.sampling_params.kv_transfer_params
        num_ext, is_async = self.connector.get_num_new_matched_tokens(req, params, num_hit)
        if num_ext <= 0 or not is_async:
            return None
        if self.kv.allocate_slots(req, num_ext, hit, cache=False) is None:
            return False
        self.waiting.popleft()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        if req.times.first_scheduled_s is None:
            req.times.first_scheduled_s = time.monotonic()
        self.waiting_remote[req.request_id] = req
        self._remote_hit[req.request_id] = (num_hit, num_ext)
        # Sliding groups: the producer released (sent -1 for) the blocks behind what a query at the last prompt
        # token reads; none of ours there is ever filled, so it must not be held, nor cached for prefix hits.
        self.kv.release_stale_blocks(req, min(num_hit + num_ext, req.num_tokens - 1))
        self.connector.update_state_after_alloc(req, params, self.kv.block_ids(req.request_id, placeholder=-1),
                                                [len(g) for g in hit.blocks])
        return True

    def update_kv_connector_output(self, out: KVConnectorOutput | None) -> None:
        """Reads that ended (the request rejoins the front of the queue: with its prompt computed but the last
        token, or - the read failed - with nothing, computing its prompt here) and held prompts now read."""
        if self.connector is None or out is None:
            return
        self.connector.update_connector_output(out)
        for rid in [*out.finished_recving, *out.failed_recving]:
            orphan = self._orphan_loads.pop(rid, None)
            if orphan is not None:
                self.kv.free(orphan)
                self.connector.request_finished(orphan, None, False, [], time.monotonic())
        back: list[Request] = []
        for rid in out.finished_recving:
            req = self.waiting_remote.pop(rid, None)
            if req is None:
                continue  # aborted meanwhile
            num_hit, num_ext = self._remote_hit.pop(rid, (0, 0))
            # Never the last token: it runs here, its logits sample (a remote prefill supplies the whole prompt).
            req.num_computed_tokens = min(num_hit + num_ext, req.num_tokens - 1)
            req.num_cached_tokens = req.num_computed_tokens
            self.prompt_tokens_cached += num_hit
            self.prompt_tokens_received += max(0, min(req.num_computed_tokens, req.num_prompt_tokens) - num_hit)
            req.status = RequestStatus.WAITING
            back.append(req)
        for rid, why in out.failed_recving.items():
            req = self.waiting_remote.pop(rid, None)
            if req is None:
                continue
            self._remote_hit.pop(rid, None)
            logger.warning("request %s: reading its prompt's KV failed (%s); computing the prompt here", rid, why)
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            back.append(req)
        self._requeue_front(back)
        for rid in out.finished_sending:
            self._release_held(rid)

    def _release_held(self, rid: str) -> None:
        req = self.held.pop(rid, None)
        if req is not None:
            self._free_kv(req)  # its reader is done: an offloading tier may keep the prompt's blocks

    # -- the step ----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        new_reqs: list[Request] = []
        cached: list[tuple[Request, list[list[int]]]] = []
        if self.connector is not None:
            for rid in self.connector.expired_sends(time.monotonic()):
                self._release_held(rid)

        # Slots a drafter writes past each request's step tokens: allocated, never counted as written (cached).
        lookahead = self.config.num_lookahead_tokens
        # 1) running requests, FCFS
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            known = req.num_tokens - req.num_computed_tokens
            spec = self._drafts_to_verify(req, known, budget)
            num_new = min(known + len(spec), budget)
            if num_new <= 0:
                i += 1
                continue
            while (blocks := self.kv.allocate_slots(req, num_new, num_lookahead_tokens=lookahead)) is None:
                if spec:  # short of blocks: verify no drafts this step rather than preempt anyone for them
                    num_new, spec = num_new - len(spec), []
                    continue
                if self._reclaim_waiting_blocks():
                    continue
                # Newest admitted goes first (under the priority policy: the lowest priority, also the tail).
                # Requests are visited in order, so the tail was not scheduled yet this step (or it is ``req``).
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
            if spec:
                out.scheduled_spec_tokens[req.request_id] = spec
            budget -= num_new
            i += 1

        # 2) waiting requests, in order, while the budget, the seat count and the blocks allow. One whose grammar
        # is still compiling keeps its place but does not hold back those behind it.
        compiling: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if out.preempted_req_ids:
                break  # memory is short this step; admitting more would only thrash
            req = self.waiting[0]
            if req.grammar is not None and not req.grammar.ready:
                self.waiting.popleft()
                if req.grammar.error is None:
                    compiling.append(req)
                else:
                    self._finish(req, RequestStatus.FINISHED_ERROR)
                    self._error_outputs.append(self._output(req, [], None, None, RequestStatus.FINISHED_ERROR,
                                                            time.monotonic()))
                continue
            hit, num_hit = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else (None, 0)
            if self.connector is not None and req.num_computed_tokens == 0:
                parked = self._admit_remote(req, hit, num_hit)
                if parked is False:
                    if self._reclaim_waiting_blocks(keep=req):
                        continue
                    break
                if parked:
                    continue
            num_new = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
            if self.kv.allocate_slots(req, num_new, hit, num_lookahead_tokens=lookahead) is None:
                if self._reclaim_waiting_blocks(keep=req):
                    continue  # the same head again, its hit looked up afresh
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                self.prompt_tokens_cached += num_hit
            if req.times.first_scheduled_s is None:
                req.times.first_scheduled_s = time.monotonic()
            req.num_computed_tokens += num_hit
            req.status = RequestStatus.RUNNING
            if self._by_priority:
                self._insert_sorted(self.running, req)
            else:
                self.running.append(req)
            new_reqs.append(req)
            out.num_scheduled_tokens[req.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))

        for req in self._fill_grammar_bitmasks(out):  # a grammar that failed ends its own request only
            del out.num_scheduled_tokens[req.request_id]
            out.scheduled_spec_tokens.pop(req.request_id, None)
            new_reqs = [r for r in new_reqs if r is not req]
            cached = [(r, ids) for r, ids in cached if r is not req]
            self.running.remove(req)
            self._finish(req, RequestStatus.FINISHED_ERROR)
            self._error_outputs.append(self._output(req, [], None, None, RequestStatus.FINISHED_ERROR,
                                                    time.monotonic()))
        out.new_requests = [NewRequestData(r.request_id, r.prompt_token_ids, r.sampling_params,
                                           self.kv.block_ids(r.request_id), r.num_computed_tokens,
                                           list(r.output_token_ids), r.mm_images) for r in new_reqs]
        out.cached_requests = [CachedRequestData(r.request_id, ids, r.num_computed_tokens) for r, ids in cached]
        out.finished_req_ids, self._finished_ids = self._finished_ids, []
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta()
        return out

    def _fill_grammar_bitmasks(self, out: SchedulerOutput) -> list[Request]:
        """The mask rows of every constrained request that samples this step (after its known tokens, and after
        each draft it verifies). Returns the requests whose grammar raised: they must end, not the step."""
        failed = []
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]
            if req.grammar is None:
                continue
            drafts = out.scheduled_spec_tokens.get(rid, [])
            if req.num_computed_tokens + n - len(drafts) == req.num_tokens:
                try:
                    out.grammar_bitmask[rid] = req.grammar.step_bitmask(drafts)
                except Exception:
                    logger.exception("request %s: its grammar failed; ending it with an error", rid)
                    failed.append(req)
        return failed

    def take_error_outputs(self) -> list[EngineCoreOutput]:
        outputs, self._error_outputs = self._error_outputs, []
        return outputs

    def _drafts_to_verify(self, req: Request, known: int, budget: int) -> list[int]:
        """The drafts ``req`` verifies this step: only once its known tokens all fit this step, and never more than
        the budget, the context or its remaining tokens allow (every accepted draft is an output token, plus one
        more sampled after them)."""
        spec = req.spec_token_ids
        if not spec or known > budget:
            return []
        if req.grammar is not None:
            try:
                spec = req.grammar.valid_drafts(spec)
            except Exception:  # no drafts; the grammar's next use (its bitmask) ends the request if it is broken
                logger.exception("request %s: its grammar failed checking drafts", req.request_id)
                return []
        room = min(budget - known, req.max_tokens - req.num_output_tokens - 1,
                   req.max_model_len - req.num_tokens - 1)
        return spec[:max(room, 0)]

    def _reclaim_waiting_blocks(self, keep: Request | None = None) -> bool:
        """Take back the blocks of waiting requests whose prefix KV was read (by a KV connector) but which have not
        run yet: they restart from their prompt's lookup. True if any block came back."""
        freed = False
        for r in self.waiting:
            if r is not keep and r.num_computed_tokens > 0:
                self._free_kv(r)
                r.num_computed_tokens = 0
                freed = True
        if freed:
            logger.debug("took back the blocks of waiting requests whose prefix was read, for the queue's head")
        return freed

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: drop the KV, keep the tokens, go back to the front of the queue."""
        req.spec_token_ids, req.spec_confidence = [], []
        self._free_kv(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue_front([req])
        self._finished_ids.append(req.request_id)

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or preempted meanwhile
            drafts = sched.scheduled_spec_tokens.get(rid, [])
            sampled = result.sampled.get(rid)
            # Computed this step: the known tokens, and the drafts that were accepted (the tokens sampled after
            # them match the drafts); a rejected draft's KV is simply overwritten when its position is computed.
            accepted = len(sampled) - 1 if sampled and drafts else 0
            self.prompt_tokens_computed += max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens)
                                               - req.num_computed_tokens)
            req.num_computed_tokens += n - len(drafts) + accepted
            params = req.sampling_params.kv_transfer_params
            if params and params.get("do_remote_decode"):
                # A remote decoder recomputes the last prompt token: keep what a query there reads.
                self.kv.release_stale_blocks(req, min(req.num_computed_tokens, req.num_prompt_tokens - 1))
            else:
                self.kv.release_stale_blocks(req)
            if drafts:
                self.spec_stats.record(len(drafts), accepted, req.spec_confidence)
            req.spec_token_ids = result.spec_token_ids.get(rid, [])
            req.spec_confidence = result.spec_confidence.get(rid, [])
            prompt_lp = result.prompt_logprobs.get(rid)
            if rid in result.failed:  # the worker could not sample (or score) this row: it alone ends
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_ERROR)
                outputs.append(self._output(req, [], None, None, RequestStatus.FINISHED_ERROR, now))
                continue
            if not sampled:
                if prompt_lp:
                    outputs.append(self._output(req, [], None, prompt_lp, None, now))
                continue
            if req.times.first_token_s is None:
                req.times.first_token_s = now
            tokens, lps, status = [], [], None
            try:
                for tok in sampled:  # one at a time: a stop ends the request there, later tokens are dropped
                    req.append_output_token(tok.token_id)
                    tokens.append(tok.token_id)
                    self.generation_tokens += 1
                    if req.sampling_params.logprobs is not None:
                        lps.append(tok.top_logprobs or {tok.token_id: tok.logprob})
                    status = self._check_stop(req, tok.token_id)
                    if req.grammar is not None and status is None:
                        status = self._advance_grammar(req, tok.token_id)
                    if status is not None:
                        break
            except Exception:  # this request's own state (its grammar matcher): it alone ends
                logger.exception("request %s: updating it failed; ending it with an error", rid)
                status = RequestStatus.FINISHED_ERROR
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            outputs.append(self._output(req, tokens, lps if req.sampling_params.logprobs is not None else None,
                                        prompt_lp, status, now))
        if self.config.confidence_token_cost is not None:
            self._schedule_by_confidence(result)
        return outputs

    def _schedule_by_confidence(self, result: ModelRunnerOutput) -> None:
        """Confidence-scheduled verification (confidence_schedule.py): of the drafts proposed this step, keep
        for verification the ones the confidence head's ranking picks. Drafts without a confidence count as sure
        ones (DeepInfer pads 1.0)."""
        reqs = [r for rid in result.spec_token_ids if (r := self.requests.get(rid)) is not None
                and r.status == RequestStatus.RUNNING and r.spec_token_ids]
        rates = [(r.spec_confidence + [1.0] * len(r.spec_token_ids))[:len(r.spec_token_ids)] for r in reqs]
        for r, n in zip(reqs, drafts_to_verify(rates, self.config.confidence_token_cost)):
            r.spec_token_ids = r.spec_token_ids[:n]

    @staticmethod
    def _output(req: Request, tokens: list[int], lp, prompt_lp, status: RequestStatus | None,
                now: float) -> EngineCoreOutput:
        return EngineCoreOutput(
            req.request_id, tokens, lp, prompt_lp, status.finish_reason if status else None,
            req.stop_reason if status else None, max(req.num_cached_tokens, 0), req.num_preemptions,
            req.times.first_scheduled_s, now, req.kv_transfer_params if status else None)

    @staticmethod
    def _advance_grammar(req: Request, token_id: int) -> RequestStatus | None:
        """A complete grammar ends the request (nothing but EOS could follow). A token the grammar refuses although
        its mask allowed it means the grammar has reached text no token of this vocabulary can continue (e.g. a
        choice with a character the tokenizer cannot spell): the request's constraint cannot be met."""
        if not req.grammar.accept(token_id):
            req.stop_reason = (f"{INVALID_REQUEST}structured_outputs cannot be completed with this model's "
                               f"vocabulary: no token can continue the output after {req.num_output_tokens - 1} "
                               f"tokens")
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if req.grammar.is_terminated else None

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
