"""DeepSeek-V3 and V4 across ranks (gloo on 127.0.0.1, one worker process per rank): tensor parallel (heads, MLA's
latent replicated, experts split along their intermediate dimension, V4's output groups, sinks and indexer heads)
and data parallel + expert parallel (experts split over the ranks, tokens to their experts by all-to-all, idle
replicas stepping with dummy batches), and both at once (TP x EP: attention over the TP ranks, experts over every rank).
Greedy tokens identical to one process."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_deepseek_v3 import make_hf_v3, make_prompts
from helpers import load_script

from openinfer import LLM, SamplingParams

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # 2-4 worker processes per test

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


def _v4_generator():
    return load_script("make_deepseek_v4_checkpoint")


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return make_hf_v3(tmp_path_factory.mktemp("v3p"))


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return _v4_generator().make_checkpoint(tmp_path_factory.mktemp("v4p") / "tiny", "tiny", seed=0)


def run(llm: LLM, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def same(a, b, tol: float = 1e-3) -> None:
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for j, t in enumerate(x.outputs[0].token_ids):
            assert abs(x.outputs[0].logprobs[j][t] - y.outputs[0].logprobs[j][t]) < tol


V3_PROMPTS = make_prompts((5, 40, 17, 23))
V4_PROMPTS = [torch.randint(6, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
              for n in (3, 33, 52, 17)]


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2),
                                    dict(data_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "dp2-ep2"])
def test_v3(v3, layout):
    kw = dict(dtype="float32", num_kv_blocks=48, max_num_batched_tokens=32)
    one = run(LLM(str(v3), **kw), V3_PROMPTS)
    llm = LLM(str(v3), **kw, **layout)
    same(run(llm, V3_PROMPTS), one)
    if layout.get("enable_expert_parallel"):
        # One request: replica 1 has nothing to do at every step and runs dummy forwards through the MoE's
        # all-to-all; replica 0's tokens are unchanged.
        same(run(llm, V3_PROMPTS[1:2]), one[1:2])
        # What /get_load reports per dp_rank: two requests, one on each replica.
        for i, p in enumerate(V3_PROMPTS[:2]):
            llm.engine.add_request(f"load{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=2))
        llm.engine.step()
        loads = llm.engine.stats().rank_loads
        assert [(running + waiting, free < blocks) for running, waiting, free, blocks, _ in loads] == [(1, True)] * 2
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert all(kv.all_free() for kv in llm.engine.core.kvs)
    llm.engine.shutdown()


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                    dict(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2-ep2", "tp2xdp2-ep4"])
def test_v3_tensor_times_expert_parallel(v3, layout):
    """Attention split over the TP ranks, the routed experts over all TP x DP ranks (vLLM's EP size): each TP rank
    sends its share of the replica's tokens through the all-to-all, so a one-token decode leaves one rank's share
    empty; with two replicas and one request the other replica idles through dummy forwards."""
    kw = dict(dtype="float32", num_kv_blocks=48, max_num_batched_tokens=32)  # chunked prefill (40-token prompt)
    one = run(LLM(str(v3), **kw), V3_PROMPTS)
    llm = LLM(str(v3), **kw, **layout)
    same(run(llm, V3_PROMPTS), one)
    same(run(llm, V3_PROMPTS[1:2]), one[1:2])  # one request: single-token steps (and an idle replica)
    assert all(kv.all_free() for kv in llm.engine.core.kvs)
    llm.engine.shutdown()


def test_v3_four_expert_parallel_ranks(v3):
    kw = dict(dtype="float32", num_kv_blocks=48, max_num_batched_tokens=32)
    one = run(LLM(str(v3), **kw), V3_PROMPTS[:3])
    llm = LLM(str(v3), **kw, data_parallel_size=4, enable_expert_parallel=True)
    same(run(llm, V3_PROMPTS[:3]), one)  # three requests on four replicas: one idles throughout
    llm.engine.shutdown()


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2),
                                    dict(data_parallel_size=2, enable_expert_parallel=True),
                                    dict(tensor_parallel_size=2, data_parallel_size=2),
                                    dict(data_parallel_size=4, enable_expert_parallel=True),
                                    dict(tensor_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "dp2-ep2", "tp2xdp2", "dp4-ep4", "tp2-ep2"])
def test_v4(v4, layout):
    kw = dict(dtype="float32", max_model_len=128, num_kv_blocks=48, max_num_batched_tokens=32)
    one = run(LLM(str(v4), **kw), V4_PROMPTS)
    llm = LLM(str(v4), **kw, **layout)
    same(run(llm, V4_PROMPTS), one)
    llm.engine.shutdown()


def _skewed_v3(path: Path) -> Path:
    """The V3 checkpoint with experts 2 and 3 chosen by every token (a large selection bias). With two
    expert-parallel ranks and two redundant slots, rank 0 starts with experts 0-4 and rank 1 with 5-7 plus replicas
    of 0 and 1: rank 0 serves every routed pair."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = path.parent / "skewed"
    shutil.copytree(path, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            t[2:4] += 5.0
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_eplb_rebalances_a_skewed_load_without_changing_tokens(v3):
    skewed = _skewed_v3(v3)
    kw = dict(dtype="float32", num_kv_blocks=48, max_num_batched_tokens=32)
    one = run(LLM(str(skewed), **kw), V3_PROMPTS)
    llm = LLM(str(skewed), **kw, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
              num_redundant_experts=2, eplb_step_interval=4)
    eng = llm.engine
    sp = GREEDY.clone(max_tokens=12)
    for i, p in enumerate(V3_PROMPTS):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    seen: dict[int, tuple[float, float]] = {}
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
        s = eng.stats()
        seen.setdefault(s.eplb_rebalances, (s.eplb_imbalance_served, s.eplb_imbalance_rebalanced))
    assert len(seen) >= 3, seen  # at least two rebalances
    served_1, planned_1 = seen[1]
    served_2, _ = seen[2]
    # Window 1 ran on the initial placement: every pair on rank 0 (busiest / mean = 2). The rebalance puts
    # replicas of experts 2 and 3 on rank 1, and window 2, served by them, is balanced.
    assert served_1 == pytest.approx(2.0) and planned_1 < 1.3 and served_2 < 1.3
    # The tokens are those of one process (the first 8 of 12 compared with the reference run).
    for i, ref in enumerate(one):
        got = outs[f"r{i}"].outputs[0]
        assert got.token_ids[:8] == ref.outputs[0].token_ids
    llm.engine.shutdown()


def test_eplb_counters_reach_bench_json_and_metrics(v3, tmp_path):
    import json
    import subprocess
    import sys

    import httpx
    from server_utils import ServerProcess

    skewed = _skewed_v3(v3) if not (v3.parent / "skewed").exists() else v3.parent / "skewed"
    flags = ["--data-parallel-size", "2", "--enable-expert-parallel", "--enable-eplb", "--num-redundant-experts",
             "2", "--eplb-step-interval", "4", "--dtype", "float32", "--num-kv-blocks", "48"]
    out = tmp_path / "tp.json"
    # The server starts while the bench runs (each is a process with two rank processes; started one after the
    # other they left a core idle). Speed is not checked here, and rebalancing goes by engine steps, not time.
    server = ServerProcess(skewed, *flags, wait=False)
    try:
        subprocess.run([sys.executable, "-m", "openinfer", "bench", "throughput", "--model", str(skewed), *flags,
                        "--batch-sizes", "4", "--input-len", "16", "--output-len", "16", "--num-iters", "1",
                        "--warmup-iters", "0", "--output-json", str(out)], check=True, timeout=300,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
        d = json.loads(out.read_text())
        engine = d["engines"]["openinfer"]
        assert engine["parallel"]["data_parallel_size"] == 2 and engine["parallel"]["enable_eplb"]
        assert d["environment"]["num_devices"] == 2  # the engine's ranks
        assert engine["expert_load"]["num_rebalances"] >= 1 and engine["expert_load"]["imbalance_served"] >= 1.0
        point = d["points"][0]["openinfer"]
        assert point["output_throughput_per_device"] == pytest.approx(point["output_throughput"] / 2)
        server.wait_ready()
        body = {"model": str(skewed), "prompt": "hello there", "max_tokens": 12, "ignore_eos": True}
        for _ in range(2):
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        m = server.metrics()
        assert m["openinfer:eplb_rebalances_total"] >= 1
        assert m["openinfer:eplb_rank_imbalance"] >= 1.0
    finally:
        server.stop()
