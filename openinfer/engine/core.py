"""The engine core: schedulers + KV cache managers + executor. ``step()`` is schedule -> execute -> update.

It speaks only in data (``EngineCoreRequest`` in, ``EngineCoreOutput`` deltas out) and never touches a model or a
tensor: the executor does. Every accepted request ends in exactly one outcome (finished, aborted, error) and its
KV blocks go back to the pool; a failed forward ends the requests of that step with an error and the core keeps
serving; a dead executor (a rank gone) ends every open request and makes the core refuse to step again.

Data parallel (``data_parallel_size`` D): D attention replicas, each with its own scheduler, KV cache manager and
requests (on its own group of ranks). A new request goes to the replica whose prefix cache already holds most of
its prompt, unless that replica is much busier; otherwise to the least loaded one (fewest requests, then the
emptiest KV cache) - ``_place``. Every step schedules each replica and runs them together in one executor call, which keeps
replicas whose layers meet in collectives (expert-parallel MoE) stepping in lockstep.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

from openinfer.config import EngineConfig
from openinfer.engine import fault_inject
from openinfer.engine.core_io import EngineCoreOutput, EngineCoreRequest
from openinfer.engine.kv_cache_manager import KVCacheManager
from openinfer.engine.kv_plan import plan_kv_blocks
from openinfer.engine.request import Request, RequestStatus
from openinfer.engine.scheduler import Scheduler
from openinfer.engine.spec_stats import SpecDecodeStats
from openinfer.distributed.kv_transfer.stats import KVOffloadStats, KVTransferStats
from openinfer.executor.abstract import Executor, ExecutorFailed
from openinfer.kv_cache_interface import bytes_per_token, kv_startup_message
from openinfer.kv_events import KVEventBatch
from openinfer.step_io import ExpertLoadStats, ModelRunnerOutput
from openinfer.structured_outputs.manager import GrammarCompiler, RequestGrammar

logger = logging.getLogger(__name__)

# With nothing to compute but KV transfers in flight, how long a step waits before polling them again (the engine
# loop would otherwise spin a core that the transfer itself needs).
_POLL_IDLE_S = 0.005
# Data-parallel placement (``EngineCore._place``): a replica's cached prefix draws a request when it covers at least
# this share of the prompt (sglang-router's cache_threshold) and the replica is at most this many requests busier
# than the least loaded one (or half that one's count, when larger).
_PLACE_MIN_HIT = 0.5
_PLACE_SLACK = 2


class EngineDeadError(RuntimeError):
    """The engine cannot step any more (a worker rank died): every open request has ended with an error."""


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int  # in the first KV group's pools, summed over data-parallel replicas
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # Expert load balancing (zero / 1.0 without it): rebalances so far, and the busiest expert-parallel rank's
    # tokens over the mean in the last window, as served and under the placement it then moved to.
    eplb_rebalances: int = 0
    eplb_imbalance_served: float = 1.0
    eplb_imbalance_rebalanced: float = 1.0
    # Speculative decoding, summed over replicas (vLLM's spec_decode_* counters).
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # Steps in a row whose forward failed (0 after any that succeeded): the server's readiness reads it.
    consecutive_failed_steps: int = 0
    # Where prompt tokens came from (computed here, local prefix-cache hits, read from a remote prefill instance)
    # and tokens generated here; KV transfer counters (None without a KV connector).
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_received: int = 0
    generation_tokens: int = 0
    kv_transfer: KVTransferStats | None = None
    kv_offload: KVOffloadStats | None = None  # the offloading tier's counters (None without one)
    num_held_for_transfer: int = 0  # ended requests whose blocks wait for a remote reader
    # Per data-parallel replica, in rank order: (running, waiting, free blocks and blocks of its first KV group,
    # KV usage over all its groups) - what a router's /get_load asks per dp_rank.
    rank_loads: list[tuple[int, int, int, int, float]] = field(default_factory=list)


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None,
                 grammar_compiler: GrammarCompiler | None = None) -> None:
        self.config = config
        self.grammar_compiler = grammar_compiler
        self.max_model_len = config.model.max_model_len
        self.dead_reason: str | None = None
        self.consecutive_failed_steps = 0
        self._fault = fault_inject.from_env()  # tests only; None in production
        self.expert_load = ExpertLoadStats()
        self.executor = (executor_class or Executor.get_class(config))(config)
        cache, sched = config.cache, config.scheduler
        self.kv_specs = self.executor.get_kv_cache_spec()
        budget = self.executor.determine_kv_budget()  # also the warm-up at the largest step
        self.num_kv_blocks = plan_kv_blocks(
            self.kv_specs, block_size=cache.block_size, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens, max_model_len=self.max_model_len,
            budget=budget, num_kv_blocks=cache.num_kv_blocks)
        self.executor.initialize_kv_cache(self.num_kv_blocks)
        self.kvs = [KVCacheManager(self.kv_specs, self.num_kv_blocks, cache.block_size, cache.enable_prefix_caching)
                    for _ in range(config.parallel.data_parallel_size)]
        self._tier_tmpdir: str | None = None  # the offloading tier's own temporary folder (no path given)
        # One connector per data-parallel replica (its own engine id, blocks, ranks and tier index); replica 0's
        # answers for the instance where one is asked (request validation).
        self.kv_connectors = self._make_kv_connectors()
        self.kv_connector = self.kv_connectors[0]
        self.schedulers = [Scheduler(sched, kv, c) for kv, c in zip(self.kvs, self.kv_connectors)]
        self._replica_of: dict[str, int] = {}  # request id -> data-parallel replica
        self.kv_bytes_per_token = bytes_per_token(self.kv_specs, cache.block_size)
        self.startup_message = kv_startup_message(self.kv_specs, self.num_kv_blocks, cache.block_size,
                                                  self.max_model_len)

    def _make_kv_connectors(self) -> list:
        """The scheduler side of the configured KV connectors (pure Python) per data-parallel replica: PD's
        transfer connector, told where its ranks' side channels listen (each picked its port when its cache was
        registered), and the offloading tier's, side by side where both are configured."""
        transfers = self._make_transfer_connectors()
        if self.config.kv_offload is None:
            return transfers
        from openinfer.engine.kv_tier import make_offloading_connectors

        tiers, self._tier_tmpdir = make_offloading_connectors(self.config, self.kv_specs, self.executor)
        if transfers[0] is None:
            return tiers
        from openinfer.distributed.kv_transfer.multi import MultiConnectorScheduler

        return [MultiConnectorScheduler(transfer, tier) for transfer, tier in zip(transfers, tiers)]

    def _transfer_stats(self) -> KVTransferStats | None:
        if self.config.kv_transfer is None:
            return None
        total = KVTransferStats()
        for c in self.kv_connectors:
            for k, v in vars(getattr(c, "transfer", c).stats).items():
                setattr(total, k, getattr(total, k) + v)
        return total

    @property
    def _tier_stats(self):
        """The offloading tier's counters, summed over the replicas' (None without a tier)."""
        if self.config.kv_offload is None:
            return None
        from openinfer.distributed.kv_transfer.stats import KVOffloadStats

        return KVOffloadStats.total([getattr(c, "tier", c).stats for c in self.kv_connectors])

    def _make_transfer_connectors(self) -> list:
        kt = self.config.kv_transfer
        dp, tp = self.config.parallel.data_parallel_size, self.config.parallel.tensor_parallel_size
        if kt is None:
            return [None] * dp
        import uuid

        from openinfer.distributed.kv_transfer.nixl_scheduler import NixlConnectorScheduler
        from openinfer.distributed.kv_transfer.ranks import replica_engine_id

        base = kt.engine_id or uuid.uuid4().hex
        infos = self.executor.collective_rpc("init_kv_connector", (base,))  # rank order: replica by replica
        connectors = []
        for d in range(dp):
            c = NixlConnectorScheduler(kt, [s.tokens_per_block(self.config.cache.block_size) for s in self.kv_specs],
                                       replica_engine_id(base, d, dp), tp)
            ranks = infos[d * tp:(d + 1) * tp]
            c.set_side_channel({"host": ranks[0]["host"], "port": ranks[0]["port"],
                                "ports": [r["port"] for r in ranks]})
            connectors.append(c)
        return connectors

    @property
    def kv(self) -> KVCacheManager:
        """Replica 0's KV cache manager (the only one without data parallelism)."""
        return self.kvs[0]

    @property
    def scheduler(self) -> Scheduler:
        return self.schedulers[0]

    # -- requests ----------------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> int:
        """Enqueue on the least loaded replica (returned); raises ValueError (and changes nothing) when the
        request can never fit the cache."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request.request_id in self._replica_of:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        req = Request(request.request_id, request.prompt_token_ids, request.sampling_params, self.max_model_len,
                      request.arrival_s, request.priority, request.mm_images)
        spec = request.sampling_params.structured_outputs
        if spec is not None:
            if self.grammar_compiler is None:
                raise ValueError("structured_outputs needs an engine built with a grammar backend")
            # Compiles on the compiler's threads (or is already cached); the scheduler admits it once ready.
            req.grammar = RequestGrammar(self.grammar_compiler.submit(spec))
        params = request.sampling_params.kv_transfer_params
        if params is not None:
            if self.kv_connector is None:
                raise ValueError("kv_transfer_params needs an engine started with kv_transfer_config "
                                 "(--kv-transfer-config)")
            self.kv_connector.validate_params(params, req.num_prompt_tokens, self.config.cache.block_size)
        end = req.num_prompt_tokens + req.max_tokens
        for name, need in self.kv.blocks_needed(end).items():
            have = self.kv.num_blocks[name]
            if need > have:
                raise ValueError(
                    f"request needs up to {need} KV blocks ({req.num_prompt_tokens} prompt + {req.max_tokens} new "
                    f"tokens) but the whole KV cache has {have} blocks; lower max_tokens or grow the cache")
        replica = self._place(req)
        self.schedulers[replica].add_request(req)
        self._replica_of[req.request_id] = replica
        return replica

    def _place(self, req: Request) -> int:
        """SGLang's cache-aware rule, applied to the replicas inside this instance: an agent's next turn, or a
        request sharing a long prefix, finds its history only on the replica that computed it (the least-loaded
        pick alone left the agentic trace's cached share at 54-57 % of its 64 %, docs/results/pd_agentic).
        The replica with the longest hit wins when the hit covers at least ``_PLACE_MIN_HIT`` of the prompt and
        the replica runs at most ``_PLACE_SLACK`` (or half the least loaded one's count) more requests; else, or
        on a tie, the least loaded. Replicas stepping in lockstep (expert parallelism) pay for imbalance on
        every step, hence the bound."""
        replicas = range(len(self.schedulers))
        least = min(replicas, key=self._load)
        if len(self.schedulers) == 1:
            return least
        hits = [self.kvs[r].cached_prefix_tokens(req) for r in replicas]
        best = max(replicas, key=lambda r: (hits[r], -self.schedulers[r].num_unfinished))
        if hits[best] <= hits[least] or hits[best] < _PLACE_MIN_HIT * req.num_prompt_tokens:
            return least
        busy, idle = self.schedulers[best].num_unfinished, self.schedulers[least].num_unfinished
        return best if busy - idle <= max(_PLACE_SLACK, idle // 2) else least

    def _load(self, replica: int) -> tuple[int, float]:
        s = self.schedulers[replica]
        return s.num_unfinished, self.kvs[replica].usage

    def abort_requests(self, request_ids: list[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        for rid in request_ids:
            replica = self._replica_of.pop(rid, None)
            if replica is not None:
                self.schedulers[replica].finish_requests([rid], status)

    def has_unfinished_requests(self) -> bool:
        """Also while KV transfers are in flight (held prompts, reads): the steps poll the connector."""
        return any(s.num_unfinished or s.has_connector_work() for s in self.schedulers)

    # -- the step ----------------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        scheds = [s.schedule() for s in self.schedulers]
        failed = [o for s in self.schedulers for o in s.take_error_outputs()]  # grammars that did not compile
        for o in failed:
            self._replica_of.pop(o.request_id, None)
        if self._fault is not None and not all(s.empty for s in scheds):
            self._fault.before_step()
        try:
            if all(s.empty for s in scheds):
                polling = any(s.has_connector_work() for s in self.schedulers)
                if any(s.finished_req_ids for s in scheds) or polling:  # workers drop what ended; poll transfers
                    results = self.executor.execute_model(scheds)
                    for scheduler, result in zip(self.schedulers, results):
                        scheduler.update_kv_connector_output(result.kv_connector_output if result else None)
                    if polling:
                        time.sleep(_POLL_IDLE_S)
                return failed
            if self._fault is not None:
                self._fault.before_forward()
            results = self.executor.execute_model(scheds)
        except ExecutorFailed as e:
            self._die(str(e))
            raise EngineDeadError(self.dead_reason) from e
        except Exception:
            # A failed forward must not strand requests: each scheduled one ends with an error and its blocks
            # return to the pool; the engine keeps serving the rest.
            ids = [rid for s in scheds for rid in s.num_scheduled_tokens]
            logger.exception("model step failed; finishing %d requests with an error", len(ids))
            self.consecutive_failed_steps += 1
            return self._end_with_error(ids)
        self.consecutive_failed_steps = 0
        outputs: list[EngineCoreOutput] = failed
        for result in results:
            if result is not None and result.expert_load is not None:
                self.expert_load = result.expert_load
        for scheduler, sched, result in zip(self.schedulers, scheds, results):
            scheduler.update_kv_connector_output(result.kv_connector_output if result else None)
            if not sched.empty:
                outputs += scheduler.update_from_output(sched, result or ModelRunnerOutput())
        for o in outputs:
            if o.finish_reason is not None:
                self._replica_of.pop(o.request_id, None)
        return outputs

    def _end_with_error(self, ids: list[str]) -> list[EngineCoreOutput]:
        done = []
        for rid in ids:
            replica = self._replica_of.pop(rid, None)
            if replica is not None:
                done += self.schedulers[replica].finish_requests([rid], RequestStatus.FINISHED_ERROR)
        now = time.monotonic()
        return [EngineCoreOutput(r.request_id, [], finish_reason="error",
                                 num_cached_tokens=max(r.num_cached_tokens, 0), num_preemptions=r.num_preemptions,
                                 first_scheduled_s=r.times.first_scheduled_s, timestamp_s=now) for r in done]

    def _die(self, reason: str) -> None:
        """Every open request ends with an error and gives its blocks back; no step runs again."""
        self.dead_reason = f"engine failed: {reason}"
        ids = list(self._replica_of)
        self._end_with_error(ids)
        logger.error("%s; %d open requests ended with an error", self.dead_reason, len(ids))

    # -- introspection -----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pools = [kv.groups[0].pool for kv in self.kvs]
        return EngineStats(
            num_running=sum(len(s.running) for s in self.schedulers),
            num_waiting=sum(len(s.waiting) + len(s.waiting_remote) for s in self.schedulers),  # vLLM counts both
            kv_cache_usage=max(kv.usage for kv in self.kvs),
            num_free_blocks=sum(p.num_free_blocks for p in pools),
            num_blocks=sum(p.num_blocks for p in pools),
            prefix_cache_queries=sum(kv.stats.queries for kv in self.kvs),
            prefix_cache_hits=sum(kv.stats.hits for kv in self.kvs),
            num_preemptions=sum(s.num_preemptions for s in self.schedulers),
            eplb_rebalances=self.expert_load.num_rebalances,
            eplb_imbalance_served=self.expert_load.imbalance_served,
            eplb_imbalance_rebalanced=self.expert_load.imbalance_rebalanced,
            spec_decode=functools.reduce(SpecDecodeStats.merge, (s.spec_stats for s in self.schedulers),
                                         SpecDecodeStats()),  # a snapshot, never the live counters
            consecutive_failed_steps=self.consecutive_failed_steps,
            prompt_tokens_computed=sum(s.prompt_tokens_computed for s in self.schedulers),
            prompt_tokens_cached=sum(s.prompt_tokens_cached for s in self.schedulers),
            prompt_tokens_received=sum(s.prompt_tokens_received for s in self.schedulers),
            generation_tokens=sum(s.generation_tokens for s in self.schedulers),
            kv_transfer=self._transfer_stats(),
            kv_offload=self._tier_stats,
            num_held_for_transfer=sum(len(s.held) for s in self.schedulers),
            rank_loads=[(len(s.running), len(s.waiting) + len(s.waiting_remote), p.num_free_blocks, p.num_blocks,
                         kv.usage) for s, p, kv in zip(self.schedulers, pools, self.kvs)],
        )

    def reset_prefix_cache(self) -> int:
        return sum(kv.reset_prefix_cache() for kv in self.kvs)

    # -- KV cache events ---------------------------------------------------------------------------------
    def enable_kv_events(self) -> None:
        """Start recording BlockStored / BlockRemoved / AllBlocksCleared in every replica's cache."""
        if not all(kv.record_events() for kv in self.kvs):
            raise ValueError("KV cache events need prefix caching and a whole-life KV group of block_size tokens")
        if self.config.kv_offload is not None:
            for c in self.kv_connectors:
                c.record_events()  # an offloading tier's stores and evictions (medium "DISK")

    def take_kv_events(self) -> list[KVEventBatch]:
        """What the caches recorded since the last call, one batch per data-parallel replica that has any."""
        now = time.time()
        out = []
        for rank, kv in enumerate(self.kvs):
            events = kv.take_events()
            if self.config.kv_offload is not None:
                events += self.kv_connectors[rank].take_events()
            if events:
                out.append(KVEventBatch(now, events, rank))
        return out

    def shutdown(self) -> None:
        if (self.config.kv_offload is not None and self.dead_reason is None
                and any(c.has_unsent_stores for c in self.kv_connectors)):
            # Blocks released by the last step are still to be copied out: one empty step hands them over (the
            # worker side finishes its writes when it shuts down), so a restart finds them.
            from openinfer.step_io import SchedulerOutput

            try:
                self.executor.execute_model([SchedulerOutput(kv_connector_metadata=c.build_connector_meta())
                                             for c in self.kv_connectors])
            except Exception:
                logger.exception("KV tier: handing over the last stores failed")
        self.executor.shutdown()
        if self._tier_tmpdir is not None:
            import shutil

            shutil.rmtree(self._tier_tmpdir, ignore_errors=True)
