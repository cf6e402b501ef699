"""DeepSeek-V3 and V4 across ranks (gloo on 127.0.0.1, one worker process per rank): tensor parallel (heads, MLA's
latent replicated, experts split along their intermediate dimension, V4's output groups, sinks and indexer heads)
and data parallel + expert parallel (experts split over the ranks, tokens to their experts by all-to-all, idle
replicas stepping with dummy batches). Greedy tokens identical to one process."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from test_deepseek_v3 import make_hf_v3, make_prompts

from openinfer import LLM, SamplingParams

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


def _v4_generator():
    spec = importlib.util.spec_from_file_location("make_v4", ROOT / "scripts" / "make_deepseek_v4_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
                                    dict(tensor_parallel_size=2, data_parallel_size=2)],
                         ids=["tp2", "dp2-ep2", "tp2xdp2"])
def test_v4(v4, layout):
    kw = dict(dtype="float32", max_model_len=128, num_kv_blocks=48, max_num_batched_tokens=32)
    one = run(LLM(str(v4), **kw), V4_PROMPTS)
    llm = LLM(str(v4), **kw, **layout)
    same(run(llm, V4_PROMPTS), one)
    llm.engine.shutdown()
