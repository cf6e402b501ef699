"""The multiprocess executor: one worker process per rank on this machine, driven over ZeroMQ.

Every call goes to every rank (msgpack, worker/rpc.py) and every rank answers; a step's sampled tokens come from
rank 0. The engine process never joins a collective itself, so it can always notice a dead rank: while it waits
for answers it checks every worker process, and a rank that exits, or answers with an error, fails the whole
deployment at once (``ExecutorFailed`` naming the rank) instead of leaving the others blocked in a collective.
Workers are started with ``python -m openinfer.worker.worker_main`` and the engine config as JSON, never pickle.
"""
from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import time
import weakref
from typing import Any

import msgspec
import zmq

from openinfer import envs
from openinfer.config import engine_config_to_json
from openinfer.distributed.kv_transfer.ranks import KVOutputAggregator
from openinfer.executor.abstract import Executor, ExecutorFailed
from openinfer.step_io import ModelRunnerOutput, SchedulerOutput
from openinfer.worker import rpc

logger = logging.getLogger(__name__)

# How long workers may take to join the process groups and load their shards.
START_TIMEOUT_S = envs.WORKER_START_TIMEOUT_S
_POLL_MS = 50


def _rendezvous_store() -> tuple[Any, str]:
    """The ranks' rendezvous store, served from this process on a port the kernel picks while it is bound.

    A port found free here and handed to rank 0 to listen on later can be taken in between (seen: EADDRINUSE in
    a PD test, with other deployments' ranks opening connections on the same host); a store bound here before the
    ranks start has no such window. The ranks join it as clients (``store://``, parallel_state.py)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, f"store://127.0.0.1:{store.port}"


def _stop(procs: list[subprocess.Popen], exit_wait_s: float = 0.0) -> None:
    """Give the workers ``exit_wait_s`` to exit by themselves, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + exit_wait_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _close_zmq(sock: zmq.Socket, ctx: zmq.Context) -> None:
    sock.close(linger=0)
    ctx.term()


class MultiprocExecutor(Executor):
    # Where worker ranks find the executor's socket; a launcher placing ranks on other machines binds wider.
    bind_host = "127.0.0.1"

    def _init_executor(self) -> None:
        world = self.config.parallel.world_size
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{self.bind_host}")
        # An executor dropped without shutdown (a caller's exception) is collected with its socket and context in
        # one cycle; should the context be finalized first, its term() waits forever for the open socket (seen:
        # pytest hung at exit after a failed test). The finalizer keeps both alive and closes them in order.
        self._zmq_finalizer = weakref.finalize(self, _close_zmq, self._sock, self._ctx)
        self._ids = [f"rank-{r}".encode() for r in range(world)]
        self._calls = itertools.count()
        self._failed: str | None = None
        try:
            self._start_workers(engine_config_to_json(self.config), f"tcp://{self._rpc_host()}:{port}")
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        par = self.config.parallel
        logger.info("started %d worker processes (tensor_parallel_size=%d, data_parallel_size=%d)", world,
                    par.tensor_parallel_size, par.data_parallel_size)

    def _rpc_host(self) -> str:
        return self.bind_host

    def _start_workers(self, config_json: str, rpc_address: str) -> None:
        """One ``worker_main`` process per rank on this machine."""
        world = len(self._ids)
        env = dict(os.environ)
        # The host's cores are shared by the ranks (one torch thread pool each) unless the user said otherwise.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
        self._store, dist_init = _rendezvous_store()  # kept for the deployment's life: groups are made through it
        cmd = [sys.executable, "-m", "openinfer.worker.worker_main", "--config-json", config_json,
               "--rpc-address", rpc_address, "--dist-init", dist_init]
        self.procs = [subprocess.Popen(cmd + ["--rank", str(r)], env=env) for r in range(world)]
        self._finalizer = weakref.finalize(self, _stop, self.procs)

    def _dead_ranks(self) -> list[tuple[int, str]]:
        """(rank, what happened) for every worker that is gone."""
        return [(r, f"worker rank {r} (pid {p.pid}) exited with code {p.returncode}")
                for r, p in enumerate(self.procs) if p.poll() is not None]

    def _stop_workers(self, exit_wait_s: float) -> None:
        self._finalizer.detach()
        _stop(self.procs, exit_wait_s)

    def _wait_ready(self) -> None:
        pending = set(range(len(self._ids)))
        deadline = time.monotonic() + START_TIMEOUT_S
        while pending:
            for rank, payload in self._recv_some():
                ready = msgspec.msgpack.decode(payload, type=rpc.Ready)
                if not ready.ok:
                    raise ExecutorFailed(f"worker rank {rank} failed to start: {ready.error}")
                pending.discard(rank)
            if time.monotonic() > deadline:
                raise ExecutorFailed(f"worker ranks {sorted(pending)} did not start within {START_TIMEOUT_S:.0f} s")

    def _recv_some(self) -> list[tuple[int, bytes]]:
        """Messages that arrived within one poll interval; raises if a worker process has exited."""
        got = []
        if self._sock.poll(_POLL_MS):
            while True:
                try:
                    ident, payload = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                got.append((self._ids.index(ident), payload))
        if not got:
            self._check_alive()
        return got

    def _check_alive(self) -> None:
        dead = self._dead_ranks()
        if dead:
            self._fail(dead[0][1])

    def _fail_on_error(self, rank: int, method: str, error: str | None) -> None:
        """A rank's call failed. If another rank has died (its peers see a reset connection in the middle of a
        collective), that death is the cause to report."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for r, what in self._dead_ranks():
                if r != rank:
                    self._fail(f"{what} (rank {rank} then failed {method})")
            time.sleep(0.05)
        self._fail(f"worker rank {rank}: {method} failed: {error}")

    def _fail(self, reason: str) -> None:
        self._failed = reason
        logger.error("deployment failed: %s", reason)
        self.shutdown()
        raise ExecutorFailed(reason)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        call_type = rpc.METHODS[method]
        call_id = next(self._calls)
        payload = msgspec.msgpack.encode(rpc.Request(call_id, call_type(*args, **(kwargs or {}))))
        return self._round_trip(call_id, method, call_type, [payload] * len(self._ids))

    def execute_model(self, scheduler_outputs: list[SchedulerOutput]) -> list[ModelRunnerOutput | None]:
        """Each rank gets its replica's batch (encoded once per replica); each replica's first rank answers."""
        tp = self.config.parallel.tensor_parallel_size
        call_id = next(self._calls)
        lockstep = self.config.parallel.lockstep and any(not s.empty for s in scheduler_outputs)
        per_replica = [msgspec.msgpack.encode(rpc.Request(call_id, rpc.ExecuteModel(s, lockstep)))
                       for s in scheduler_outputs]
        results = self._round_trip(call_id, "execute_model", rpc.ExecuteModel,
                                   [per_replica[r // tp] for r in range(len(self._ids))])
        drivers = results[::tp]
        if self.config.kv_transfer is not None and tp > 1:
            # A prompt moved (or a held one was read) once every rank of the replica says so: each moves its shard.
            if not hasattr(self, "_kv_aggregators"):
                self._kv_aggregators = [KVOutputAggregator(tp) for _ in drivers]
            for d, agg in enumerate(self._kv_aggregators):
                ranks = results[d * tp:(d + 1) * tp]
                kv = agg.merge([o.kv_connector_output if o is not None else None for o in ranks])
                if drivers[d] is None and kv is not None:
                    drivers[d] = ModelRunnerOutput(kv_connector_output=kv)
                elif drivers[d] is not None:
                    drivers[d].kv_connector_output = kv
        return drivers

    def _round_trip(self, call_id: int, method: str, call_type: type, payloads: list[bytes]) -> list[Any]:
        """Send rank r ``payloads[r]``, then wait for every rank's answer (watching that every rank lives)."""
        if self._failed is not None:
            raise ExecutorFailed(self._failed)
        for ident, payload in zip(self._ids, payloads):
            self._sock.send_multipart([ident, payload])
        results: dict[int, Any] = {}
        result_type = rpc.RESULT_TYPES[call_type]
        while len(results) < len(self._ids):
            for rank, data in self._recv_some():
                reply = msgspec.msgpack.decode(data, type=rpc.Reply)
                if reply.call_id != call_id:
                    continue  # a late answer to an abandoned call
                if not reply.ok:
                    self._fail_on_error(rank, method, reply.error)
                results[rank] = msgspec.msgpack.decode(reply.value, type=result_type)
        return [results[r] for r in range(len(self._ids))]

    def shutdown(self) -> None:
        if getattr(self, "_sock", None) is None:
            return
        exit_wait_s = 0.0
        if self._failed is None:  # a clean stop: ask every rank to leave, give them a moment
            payload = msgspec.msgpack.encode(rpc.Request(next(self._calls), rpc.Shutdown()))
            for ident in self._ids:
                try:
                    self._sock.send_multipart([ident, payload], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            exit_wait_s = 5.0
        if hasattr(self, "_finalizer"):
            self._stop_workers(exit_wait_s)
        self._sock = None
        self._zmq_finalizer()
