"""How one deployment is spread over ranks: tensor, data and expert parallelism, and who runs the ranks."""
from __future__ import annotations

from dataclasses import dataclass


EXECUTOR_BACKENDS = ("auto", "uni", "mp", "ray", "external_launcher")


@dataclass(frozen=True)
class ParallelConfig:
    """How one deployment is spread over processes: ``data_parallel_size`` attention replicas (each with its own
    scheduler, KV cache and requests), each split over ``tensor_parallel_size`` ranks. Ranks are numbered
    ``dp_rank * tensor_parallel_size + tp_rank``. The executor backend runs them: ``uni`` in the engine's own
    process (one rank only), ``mp`` one worker process per rank, ``ray`` one Ray actor per rank (a Ray cluster
    spanning machines runs one deployment), ``external_launcher`` one engine per rank started
    by torchrun (or any launcher that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT: the multi-node path
    without Ray); ``auto`` picks ``uni`` for one rank, ``mp`` otherwise."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # Routed experts split over every rank (instead of each expert's intermediate split over the TP ranks): the
    # expert-parallel size is tensor_parallel_size x data_parallel_size, as vLLM's; attention stays TP-sharded.
    enable_expert_parallel: bool = False
    # Expert load balancing: count tokens per expert, and every eplb_step_interval steps re-place the experts
    # (plus num_redundant_experts replicas of the busiest) over the ranks.
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_step_interval: int = 1000
    distributed_executor_backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r}; choose one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}")
        if (self.enable_eplb or self.num_redundant_experts) and not self.enable_expert_parallel:
            raise ValueError("enable_eplb / num_redundant_experts place experts over expert-parallel ranks: set "
                             "enable_expert_parallel")
        if not isinstance(self.num_redundant_experts, int) or self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be an integer >= 0, got {self.num_redundant_experts!r}")
        if not isinstance(self.eplb_step_interval, int) or self.eplb_step_interval < 1:
            raise ValueError(f"eplb_step_interval must be an integer >= 1, got {self.eplb_step_interval!r}")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank in the engine's process, but "
                             f"tensor_parallel_size={self.tensor_parallel_size} x data_parallel_size="
                             f"{self.data_parallel_size} needs {self.world_size}; use 'mp'")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def lockstep(self) -> bool:
        """Replicas meet in collectives inside the model (expert-parallel MoE): an idle replica's ranks must
        still run a forward whenever another replica steps."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend != "auto":
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"
