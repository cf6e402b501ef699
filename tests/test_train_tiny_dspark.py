"""scripts/train_tiny_dspark.py for a few steps: the drafter's loss falls, the checkpoint it writes (DeepInfer
names; the target's tensors from stage 1, the mtp.* ones from stage 2) loads through the normal loader, and greedy
output is identical with and without drafting."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from openinfer import LLM, SamplingParams
from tests.helpers import load_script, random_prompts

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~50 s: a training subprocess and two engines
def test_train_tiny_dspark_few_steps(tmp_path):
    out = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "scripts/train_tiny_dspark.py", "--out", str(out), "--steps", "40",
                    "--batch", "32", "--lr", "3e-3", "--num-seqs", "8", "--gen-tokens", "40", "--target-steps", "2",
                    "--target-batch", "2", "--target-seq-len", "32"],
                   cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
    summary = json.loads((out / "dspark_training.json").read_text())
    losses = summary["train_losses"]
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, losses
    assert summary["target_steps"] == 2 and len(summary["target_losses"]) == 2

    trained = load_file(str(out / "model.safetensors"))
    fresh = load_file(str(load_script("make_deepseek_v41_checkpoint").make_checkpoint(
        tmp_path / "fresh", "tiny", seed=0, quantize=False) / "model.safetensors"))
    assert trained.keys() == fresh.keys()
    changed = {k for k in trained if not torch.equal(trained[k], fresh[k])}
    assert "mtp.0.main_proj.weight" in changed and "layers.0.attn.wq_a.weight" in changed
    assert "layers.3.engram.embed.weight" in changed and "embed.weight" in changed

    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, [9, 23, 31])]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(out), dtype="float32", max_model_len=128)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    del plain
    spec = LLM(str(out), dtype="float32", max_model_len=128,
               speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert spec.engine.stats().spec_decode.num_drafts > 0
