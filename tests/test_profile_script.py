"""scripts/profile_decode_step.py, the tool behind the closing notes' "where the time goes" tables, run as a user runs
it on a small DeepSeek-V3 checkpoint: decode and prefill mode, the op groups it reports, the fused decode blocks
(on, and split again with OPENINFER_DECODE_BLOCKS=0)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_deepseek_v3 import make_hf_v3

pytestmark = pytest.mark.slow  # the profiler script in a subprocess, several modes

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_decode_step.py"


def _run(path, *args: str, **env: str) -> str:
    # PYTHONPATH: the script's own directory comes first on sys.path, so without it the script imports the openinfer
    # that is installed (another checkout's, with a shared or editable install; and another kernel build)
    pythonpath = os.pathsep.join(filter(None, [str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(path), "--batch", "2", "--context", "20",
                        "--threads", "1", "--top", "40", *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": pythonpath, **env}, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def test_profile_decode_and_prefill(tmp_path, kernel_ops):
    path = make_hf_v3(tmp_path)
    out = _run(path, "--steps", "2")
    assert "decode step at batch 2, context ~20" in out and "| attention |" in out
    assert "openinfer_cpu::mla_decode_block" in out and "openinfer_cpu::moe_block" in out  # the fused blocks ran
    split = _run(path, "--steps", "2", OPENINFER_DECODE_BLOCKS="0")
    assert "openinfer_cpu::mla_decode_attention" in split and "mla_decode_block" not in split
    pre = _run(path, "--prefill")
    assert "prefill of 2 x 20 tokens" in pre and "| linear |" in pre
