"""The external-launcher executor: every rank runs the whole engine, started by ``torchrun`` (or any launcher that
sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): the multi-node path without Ray.

Each process holds its own rank's worker in-process. Every process is given the same requests in the same order
and schedules them the same way (scheduling is deterministic given the same inputs and the same KV block counts),
so the ranks stay in step with no RPC channel. What only some ranks know is exchanged over the CPU group as
msgpack bytes (never pickle): the smallest KV budget (so every rank plans the same block counts) and, with data
parallelism, each replica's sampled tokens (tensor-parallel ranks all sample the same tokens from gathered
logits, so one replica needs no exchange).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import msgspec

from openinfer.executor.abstract import Executor
from openinfer.kv_cache_interface import KVBudget
from openinfer.step_io import ModelRunnerOutput, SchedulerOutput
from openinfer.worker.worker import Worker

logger = logging.getLogger(__name__)

_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class ExternalLauncherExecutor(Executor):
    def _init_executor(self) -> None:
        missing = [k for k in _LAUNCH_ENV if k not in os.environ]
        if missing:
            raise ValueError(f"distributed_executor_backend='external_launcher' runs under torchrun (or a launcher "
                             f"that sets {', '.join(_LAUNCH_ENV)}); missing: {', '.join(missing)}")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != self.config.parallel.world_size:
            raise ValueError(f"the launcher started {world} ranks but tensor_parallel_size x data_parallel_size = "
                             f"{self.config.parallel.world_size}")
        self.worker = Worker(self.config, rank=rank, distributed_init_method="env://")
        self.worker.init_device()
        self.worker.load_model()
        if rank != 0:  # rank 0 speaks for the deployment
            logging.getLogger("openinfer").setLevel(logging.WARNING)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """This rank's answer only: every rank runs the same call itself."""
        attr = getattr(self.worker, method)
        return [attr(*args, **(kwargs or {})) if callable(attr) else attr]

    def determine_kv_budget(self) -> KVBudget:
        from openinfer.distributed.parallel_state import get_world_group

        mine = self.worker.determine_kv_budget()
        budgets = [msgspec.msgpack.decode(b, type=KVBudget)
                   for b in get_world_group().all_gather_bytes(msgspec.msgpack.encode(mine))]
        return min(budgets, key=lambda b: b.num_bytes)

    def execute_model(self, scheduler_outputs: list[SchedulerOutput]) -> list[ModelRunnerOutput | None]:
        from openinfer.distributed.parallel_state import get_world_group

        lockstep = self.config.parallel.lockstep and any(not s.empty for s in scheduler_outputs)
        mine = self.worker.execute_model(scheduler_outputs[self.worker.dp_rank], lockstep)
        if len(scheduler_outputs) == 1:
            return [mine]
        tp = self.config.parallel.tensor_parallel_size
        gathered = get_world_group().all_gather_bytes(msgspec.msgpack.encode(mine))
        return [msgspec.msgpack.decode(gathered[d * tp], type=ModelRunnerOutput)
                for d in range(len(scheduler_outputs))]

    def shutdown(self) -> None:
        """Leave the process group (idempotent). Every rank calls this at the same point of its identical
        program; a rank that exits with a live gloo group can leave its peer's teardown (and torchrun's exit
        barrier) waiting on sockets nobody closes."""
        from openinfer.distributed.parallel_state import destroy_distributed_environment

        destroy_distributed_environment()
