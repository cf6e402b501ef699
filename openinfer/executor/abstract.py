"""An executor drives the workers (one process, one device each) that hold a model's shards. The engine core
talks to its executor and never to a model.

Every executor answers the same calls: what the model's KV cache is made of, how much memory the workers can
give it, build the cache, run a step. ``collective_rpc`` calls a method on every worker and returns their
answers in rank order; the other calls are built on it. ``uni`` runs one worker in the engine's own process, ``mp``
one worker process per rank (multiproc.py); further launchers (Ray) plug in at ``get_class`` with the same calls.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from openinfer.config import EngineConfig
    from openinfer.kv_cache_interface import KVBudget, KVGroupSpec
    from openinfer.step_io import ModelRunnerOutput, SchedulerOutput

class ExecutorFailed(RuntimeError):
    """The deployment cannot run another step (a worker died, or a rank failed a call): fatal, unlike a model
    error in one step, which only fails that step's requests."""


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The executor class for ``config`` (imported lazily: the engine core loads without torch)."""
        backend = config.parallel.executor_backend
        if backend == "external_launcher":
            from openinfer.executor.external_launcher import ExternalLauncherExecutor

            return ExternalLauncherExecutor
        if backend == "ray":
            from openinfer.executor.ray_executor import RayExecutor

            return RayExecutor
        if backend == "mp":
            from openinfer.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        from openinfer.executor.uniproc import UniProcExecutor

        return UniProcExecutor

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers, initialise their devices and load the model."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call ``method`` on every worker; their results in rank order."""

    def get_kv_cache_spec(self) -> list[KVGroupSpec]:
        return self.collective_rpc("get_kv_cache_spec")[0]

    def determine_kv_budget(self) -> KVBudget:
        """The smallest budget any worker reports: every rank holds the same block counts."""
        return min(self.collective_rpc("determine_kv_budget"), key=lambda b: b.num_bytes)

    def initialize_kv_cache(self, num_blocks: dict[str, int]) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def execute_model(self, scheduler_outputs: list[SchedulerOutput]) -> list[ModelRunnerOutput | None]:
        """Run one step: ``scheduler_outputs[d]`` on data-parallel replica d's ranks. Returns each replica's
        sampled tokens (from its first rank); None for a replica that had nothing scheduled."""
        return self.collective_rpc("execute_model", (scheduler_outputs[0],))[:1]

    @property
    def load_time_s(self) -> float:
        return max(self.collective_rpc("load_time_s"))

    def shutdown(self) -> None:
        """Release the workers (idempotent)."""
