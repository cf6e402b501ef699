"""The Ray executor on a local Ray instance bound to 127.0.0.1: one actor per rank in a placement group, tokens
identical to one process; a killed actor fails the deployment naming the rank."""
from __future__ import annotations

import os
import signal
import time

import pytest
from helpers import make_dense_checkpoint

from openinfer import LLM, SamplingParams
from openinfer.engine.core import EngineDeadError

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # a local Ray instance and its actors

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 44))]


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    ray = pytest.importorskip("ray")
    for k, v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}.items():
        os.environ[k] = v
    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")), log_to_driver=False)
    yield ray
    ray.shutdown()


def run(llm):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp,
                                                         use_tqdm=False)]


def test_tp2_on_ray_matches_one_process_and_a_killed_actor_fails_it(ray_local, tmp_path):
    path = make_dense_checkpoint(tmp_path / "m", "qwen3")
    want = run(LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02))
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
              kv_cache_memory_gb=0.02)
    assert run(llm) == want
    ex = llm.engine.core.executor
    eng = llm.engine
    eng.add_request("long", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=400, ignore_eos=True))
    eng.step()
    os.kill(ex._pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"worker rank 1 \(Ray actor"):
        for _ in range(1000):
            eng.step()
    assert time.monotonic() - t0 < 15 and not eng.has_unfinished_requests()
