"""A worker process: ``python -m openinfer.worker.worker_main --rank R ...``, started by the multiprocess executor.

It builds its ``Worker`` from the engine config (JSON on the command line), joins the deployment's process groups,
loads its shard of the model, says ``Ready``, then answers calls from the executor's socket until ``Shutdown``.
It dies with the process that started it (Linux: PR_SET_PDEATHSIG), so a crashed engine never leaves ranks behind.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import traceback

import msgspec
import zmq

from openinfer.config import engine_config_from_json
from openinfer.layers.kernel_build import KernelBuildError
from openinfer.logging_utils import init_logging
from openinfer.step_io import ModelRunnerOutput
from openinfer.worker import rpc

logger = logging.getLogger("openinfer.worker")


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the executor's shutdown (and its sockets closing) still ends us
        pass


def serve(rank: int, config_json: str, rpc_address: str, dist_init: str) -> int:
    from openinfer.worker.worker import Worker

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank-{rank}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(rpc_address)
    try:
        worker = Worker(engine_config_from_json(config_json), rank=rank, distributed_init_method=dist_init)
        worker.init_device()
        worker.load_model()
    except Exception as e:
        if isinstance(e, KernelBuildError):  # says all there is to say: the compiler's error and the opt-out
            logger.error("rank %d failed to start: %s", rank, e)
        else:
            logger.exception("rank %d failed to start", rank)
        sock.send(msgspec.msgpack.encode(rpc.Ready(rank, os.getpid(), False, f"{type(e).__name__}: {e}")))
        return 1
    sock.send(msgspec.msgpack.encode(rpc.Ready(rank, os.getpid())))
    decoder = msgspec.msgpack.Decoder(rpc.Request)
    while True:
        req = decoder.decode(sock.recv())
        call = req.call
        try:
            value = _dispatch(worker, call)
            reply = rpc.Reply(req.call_id, rank, True, msgspec.msgpack.encode(value))
        except Exception as e:  # reported to the executor, which fails the deployment
            logger.error("rank %d: %s failed:\n%s", rank, type(call).__name__, traceback.format_exc())
            reply = rpc.Reply(req.call_id, rank, False, error=f"{type(e).__name__}: {e}")
        sock.send(msgspec.msgpack.encode(reply))
        if isinstance(call, rpc.Shutdown):
            return 0


def _dispatch(worker, call: rpc.Call):
    if isinstance(call, rpc.ExecuteModel):
        out = worker.execute_model(call.scheduler_output, call.lockstep)
        if worker.is_replica_driver:
            return out
        # Only each replica's first rank's tokens are read; every rank's KV connector reports (its shard's
        # transfers), which the executor combines per replica.
        kv = out.kv_connector_output
        return None if kv is None else ModelRunnerOutput(kv_connector_output=kv)
    if isinstance(call, rpc.GetKVCacheSpec):
        return worker.get_kv_cache_spec()
    if isinstance(call, rpc.DetermineKVBudget):
        return worker.determine_kv_budget()
    if isinstance(call, rpc.InitKVConnector):
        return worker.init_kv_connector(call.engine_id)
    if isinstance(call, rpc.InitializeKVCache):
        return worker.initialize_kv_cache(call.num_blocks)
    if isinstance(call, rpc.GetLoadTime):
        return worker.load_time_s
    if isinstance(call, rpc.InitKVOffload):
        return worker.init_kv_offload(call.backend, call.locations, call.fingerprint)
    if isinstance(call, rpc.Shutdown):
        worker.shutdown_kv_connector()  # an offloading tier's writes in flight finish: a restart finds them
        return None
    raise ValueError(f"unknown call {type(call).__name__}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--rpc-address", required=True)
    ap.add_argument("--dist-init", required=True)
    args = ap.parse_args(argv)
    _die_with_parent()
    init_logging()
    if args.rank != 0:  # rank 0 speaks for the deployment; the others only warn
        logging.getLogger("openinfer").setLevel(logging.WARNING)
    return serve(args.rank, args.config_json, args.rpc_address, args.dist_init)


if __name__ == "__main__":
    sys.exit(main())
