"""The engine core: scheduler + KV cache manager + executor. ``step()`` is schedule -> execute -> update.

It speaks only in data (``EngineCoreRequest`` in, ``EngineCoreOutput`` deltas out) and never touches a model or a
tensor: the executor does. Every accepted request ends in exactly one outcome (finished, aborted, error) and its
KV blocks go back to the pool; a failed forward ends the requests of that step with an error and the core keeps
serving.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from openinfer.config import EngineConfig
from openinfer.engine.core_io import EngineCoreOutput, EngineCoreRequest
from openinfer.engine.kv_cache_manager import KVCacheManager
from openinfer.engine.kv_plan import plan_kv_blocks
from openinfer.engine.request import Request, RequestStatus
from openinfer.engine.scheduler import Scheduler
from openinfer.executor.abstract import Executor, ExecutorFailed
from openinfer.kv_cache_interface import bytes_per_token, kv_startup_message

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine cannot step any more (a worker rank died): every open request has ended with an error."""


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int  # in the first KV group's pool
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        self.max_model_len = config.model.max_model_len
        self.dead_reason: str | None = None
        self.executor = (executor_class or Executor.get_class(config))(config)
        cache, sched = config.cache, config.scheduler
        self.kv_specs = self.executor.get_kv_cache_spec()
        budget = self.executor.determine_kv_budget()  # also the warm-up at the largest step
        self.num_kv_blocks = plan_kv_blocks(
            self.kv_specs, block_size=cache.block_size, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens, max_model_len=self.max_model_len,
            budget=budget, num_kv_blocks=cache.num_kv_blocks)
        self.executor.initialize_kv_cache(self.num_kv_blocks)
        self.kv = KVCacheManager(self.kv_specs, self.num_kv_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(sched, self.kv)
        self.kv_bytes_per_token = bytes_per_token(self.kv_specs, cache.block_size)
        self.startup_message = kv_startup_message(self.kv_specs, self.num_kv_blocks, cache.block_size,
                                                  self.max_model_len)

    # -- requests ----------------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Enqueue; raises ValueError (and changes nothing) when the request can never fit the cache."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        req = Request(request.request_id, request.prompt_token_ids, request.sampling_params, self.max_model_len,
                      request.arrival_s)
        end = req.num_prompt_tokens + req.max_tokens
        for name, need in self.kv.blocks_needed(end).items():
            have = self.kv.num_blocks[name]
            if need > have:
                raise ValueError(
                    f"request needs up to {need} KV blocks ({req.num_prompt_tokens} prompt + {req.max_tokens} new "
                    f"tokens) but the whole KV cache has {have} blocks; lower max_tokens or grow the cache")
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the step ----------------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        sched = self.scheduler.schedule()
        try:
            if sched.empty:
                if sched.finished_req_ids:  # workers still drop the state of what ended
                    self.executor.execute_model(sched)
                return []
            result = self.executor.execute_model(sched)
        except ExecutorFailed as e:
            self._die(str(e))
            raise EngineDeadError(self.dead_reason) from e
        except Exception:
            # A failed forward must not strand requests: each scheduled one ends with an error and its blocks
            # return to the pool; the engine keeps serving the rest.
            logger.exception("model step failed; finishing %d requests with an error",
                             len(sched.num_scheduled_tokens))
            done = self.scheduler.finish_requests(list(sched.num_scheduled_tokens), RequestStatus.FINISHED_ERROR)
            now = time.monotonic()
            return [EngineCoreOutput(r.request_id, [], finish_reason="error",
                                     num_cached_tokens=max(r.num_cached_tokens, 0),
                                     num_preemptions=r.num_preemptions,
                                     first_scheduled_s=r.times.first_scheduled_s, timestamp_s=now) for r in done]
        return self.scheduler.update_from_output(sched, result)

    def _die(self, reason: str) -> None:
        """Every open request ends with an error and gives its blocks back; no step runs again."""
        self.dead_reason = f"engine failed: {reason}"
        ids = list(self.scheduler.requests)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        logger.error("%s; %d open requests ended with an error", self.dead_reason, len(ids))

    # -- introspection -----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool = self.kv.groups[0].pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            num_free_blocks=pool.num_free_blocks,
            num_blocks=pool.num_blocks,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
