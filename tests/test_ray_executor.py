"""The Ray executor on a local Ray instance bound to 127.0.0.1: one actor per rank in a placement group, tokens
identical to one process; a killed actor fails the deployment naming the rank."""
from __future__ import annotations

import os
import signal
import time

import pytest
from helpers import make_dense_checkpoint, random_prompts, start_local_ray

from openinfer import LLM, SamplingParams
from openinfer.engine.core import EngineDeadError

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # a local Ray instance and its actors

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 44))]


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    ray = start_local_ray(tmp_path_factory.mktemp("ray"))
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


def test_pd_deepseek_tp2_and_dp2_ep_with_mtp_on_ray(ray_local, tmp_path_factory):
    """DeepSeek's serving shape with every rank a Ray actor: each actor runs its rank's NIXL agent and side channel
    as under mp. Prefill TP 2 -> decode DP 2 + EP by pull, then the reverse by push (each replica's rank registers
    with the producer's one rank), MTP k = 2 on both sides (test_pd_parallel.py's
    test_tp2_to_dp2_ep_and_back_deepseek_v3, on Ray): tokens as one process, every prompt token but the last
    moved, both pools whole."""
    pytest.importorskip("nixl")
    import json

    from test_pd_parallel import KW, _check_pd  # (it puts scripts/ on the path)

    from make_deepseek_checkpoint import make_v3

    ck = make_v3(tmp_path_factory.mktemp("pd-ray"), "tiny", overrides={"num_nextn_predict_layers": 1})
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    kt = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "load_timeout_s": 5.0}
    push = json.dumps({**kt, "kv_connector_extra_config": {"send_type": "PUT"}})  # send_type: the decoding side's
    tp2 = LLM(str(ck), kv_transfer_config=push, speculative_config=spec, tensor_parallel_size=2,
              distributed_executor_backend="ray", **KW)
    dep = LLM(str(ck), kv_transfer_config=json.dumps(kt), speculative_config=spec, data_parallel_size=2,
              enable_expert_parallel=True, distributed_executor_backend="ray", **KW)
    ref = LLM(str(ck), speculative_config=spec, **KW)
    try:
        for prod, cons, send_type in ((tp2, dep, "GET"), (dep, tp2, "PUT")):
            _check_pd({"prod": prod, send_type: cons, "ref": ref}, send_type, random_prompts(3, [40, 17, 33]))
            assert cons.engine.stats().spec_decode.num_draft_tokens > 0
    finally:
        for llm in (tp2, dep, ref):
            llm.engine.shutdown()
