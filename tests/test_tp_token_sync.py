"""Tensor parallel: the replica's first rank's sampled and accepted tokens are every rank's. Two gloo ranks on
127.0.0.1 (forked processes); rank 1 disagrees with rank 0 - a different accepted token, one more accepted draft, a
row that failed on rank 0 only - and after ``ModelRunner._take_driver_tokens`` its request states and step output
are rank 0's."""
from __future__ import annotations

import multiprocessing as mp
import socket
from types import SimpleNamespace

import pytest

pytestmark = [pytest.mark.distributed]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, q) -> None:
    import torch

    from openinfer.distributed.parallel_state import (destroy_distributed_environment, init_distributed_environment,
                                                      initialize_model_parallel)
    from openinfer.sampling_params import SamplingParams
    from openinfer.step_io import ModelRunnerOutput, SampledToken
    from openinfer.worker.input_batch import CachedRequestState, ScheduledRow
    from openinfer.worker.model_runner import ModelRunner

    init_distributed_environment(2, rank, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    initialize_model_parallel(2, 1, torch.device("cpu"))
    # What each rank sampled this step (appended already, as _emit / _verify do): None = the row failed.
    steps = {"a": ([5], [5]), "b": ([7, 8], [7, 9]), "c": ([1, 2, 3], [1, 2]), "d": (None, [4])}
    rows, out = [], ModelRunnerOutput()
    for rid, by_rank in steps.items():
        got = by_rank[rank]
        st = CachedRequestState(rid, [10, 11], SamplingParams(), [[0]], 3, [10, 11, 12] + (got or []),
                                [12] + (got or []))
        rows.append(ScheduledRow(st, 2, 1, True))
        if got is None:
            out.failed[rid] = "boom"
        else:
            out.sampled[rid] = [SampledToken(t) for t in got]
    runner = SimpleNamespace(input_batch=SimpleNamespace(append_sampled=lambda r, t: (r.state.token_ids.extend(t),
                                                                                     r.state.output_token_ids.extend(t))))
    ModelRunner._take_driver_tokens(runner, out, rows)
    q.put((rank, {r.state.req_id: (r.state.token_ids, r.state.output_token_ids) for r in rows},
           {k: [t.token_id for t in v] for k, v in out.sampled.items()}, sorted(out.failed)))
    destroy_distributed_environment()


def test_every_rank_takes_rank_zeros_tokens():
    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, rest) for r, *rest in (q.get(timeout=60) for _ in procs))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    (states0, sampled0, failed0), (states1, sampled1, failed1) = results[0], results[1]
    assert states1 == states0 and sampled1 == sampled0 and failed1 == failed0 == ["d"]
    assert states1["c"] == ([10, 11, 12, 1, 2, 3], [12, 1, 2, 3])  # rank 0 accepted one draft more
    assert states1["d"] == ([10, 11, 12], [12])  # failed on rank 0: rank 1's token is taken back
