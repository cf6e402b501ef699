"""The in-process executor: one worker, in the engine's own process and thread."""
from __future__ import annotations

from typing import Any

from openinfer.executor.abstract import Executor
from openinfer.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.config, rank=0)
        self.driver_worker.init_device()
        self.driver_worker.load_model()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        attr = getattr(self.driver_worker, method)
        return [attr(*args, **(kwargs or {})) if callable(attr) else attr]

    def shutdown(self) -> None:
        connector = self.driver_worker.model_runner.kv_connector if self.driver_worker.model_runner else None
        if connector is not None:
            connector.shutdown()
