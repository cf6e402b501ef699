"""The body of a Ray actor that hosts one worker rank: where its node is, and the worker's serving loop (the same
``worker_main.serve`` the multiprocess executor's processes run, talking to the executor over ZeroMQ)."""
from __future__ import annotations

import os
import socket


class RayWorkerHost:
    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def pid(self) -> int:
        return os.getpid()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, rank: int, config_json: str, rpc_address: str, dist_init: str) -> int:
        """Serve calls until the executor says Shutdown; returns the exit code."""
        from openinfer.logging_utils import init_logging
        from openinfer.worker.worker_main import serve

        init_logging()
        return serve(rank, config_json, rpc_address, dist_init)
