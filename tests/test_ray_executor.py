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
    # Before ray is imported: it reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import, and only with it 0 does
    # it honour _node_ip_address (else the node, its actors and the executor's socket sit on the host's external
    # address). tests/conftest.py sets it too, for a worker process that imported ray earlier.
    for k, v in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}.items():
        os.environ[k] = v
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")), log_to_driver=False)
    assert ray.util.get_node_ip_address() == "127.0.0.1", "the test Ray node must stay on loopback"
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


def test_pd_between_two_tp2_deployments_on_ray(ray_local, tmp_path):
    """The KV connector under the Ray executor: every actor runs its rank's NIXL agent and side channel, as under
    mp (tests/test_pd_parallel.py); a TP 2 decoder reads a TP 2 producer's shards, tokens as one process, both
    pools whole afterwards."""
    pytest.importorskip("nixl")
    import json

    from helpers import random_prompts
    from test_kv_nixl_engines import stepping

    path = str(make_dense_checkpoint(tmp_path / "llama"))
    kw = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=16)

    def pd(role):
        return LLM(path, kv_transfer_config=json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                                        "load_timeout_s": 5.0}),
                   tensor_parallel_size=2, distributed_executor_backend="ray", **kw)

    prod, cons, ref = pd("kv_producer"), pd("kv_consumer"), LLM(path, **kw)
    try:
        for prompt in random_prompts(0, [40, 17]):
            sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            want = ref.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
            held = prod.generate([prompt], SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={
                "do_remote_decode": True}), use_tqdm=False)[0].kv_transfer_params
            with stepping(prod):
                got = cons.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                             kv_transfer_params=held), use_tqdm=False)[0]
            assert got.outputs[0].token_ids == want and got.num_cached_tokens == len(prompt) - 1
        for _ in range(200):
            if not prod.engine.has_unfinished_requests():
                break
            prod.engine.step()
        assert cons.engine.stats().kv_transfer.loads_ok == 2
        assert prod.engine.core.kv.all_free() and cons.engine.core.kv.all_free()
    finally:
        for llm in (prod, cons, ref):
            llm.engine.shutdown()
