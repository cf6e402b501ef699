"""``distributed_executor_backend='external_launcher'``: the multi-node path without Ray. Two torchrun invocations
play two "nodes" on loopback (c10d rendezvous), one rank each; every rank runs the engine and gets the tokens one
process gets."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_dense_checkpoint
from server_utils import free_port

from openinfer import LLM, SamplingParams

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # torchrun launches of two ranks

SCRIPT = Path(__file__).parent / "torchrun_generate.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


@pytest.mark.parametrize("tp, dp", [(2, 1), (1, 2)])
def test_two_nodes_on_loopback_match_one_process(tmp_path, tp, dp):
    path = make_dense_checkpoint(tmp_path / "m", "llama")
    want = [o.outputs[0].token_ids for o in LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02).generate(
        [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9], list(range(10, 44)), [77] * 17)],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    port = free_port()
    # PYTHONPATH: the ranks run this checkout's openinfer (torchrun's script dir is tests/, so from another
    # worktree they would import the installed copy's code, and build its kernels, instead)
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "tokens"
    nodes = [subprocess.Popen(
        [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "openinfer-test",
         "--master-addr", "127.0.0.1", str(SCRIPT), str(path), str(out), str(tp), str(dp)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    logs = []
    for p in nodes:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in nodes), "\n".join(logs)[-4000:]
    for rank in (0, 1):
        assert json.loads(Path(f"{out}.rank{rank}.json").read_text()) == want
