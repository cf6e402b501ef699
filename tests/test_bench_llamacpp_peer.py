"""``bench peers``' llama.cpp side without llama.cpp: detection, GGUF cache keying and the conversion steps,
the child's spec and command, and reading back a child JSON recorded from a real llama-cpp-python 0.3.36 run
(``data/llamacpp_peer_child.json``: llama-200m converted to an f32 GGUF, batch 8, input 128 / output 32; its
first sequence's 32 greedy tokens equal HF float32 ``generate``'s on the same prompt; recorded on a heavily
loaded host, so its timings are slow).
Nothing here pretends llama.cpp ran: the one llama.cpp result is that recorded file, parsed as the parent
parses it."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import peer_args

from openinfer.bench import llamacpp_peer as lp
from openinfer.bench import peers
from openinfer.bench import results as R
from openinfer.bench.peers_report import _llamacpp_lines, results_table
from openinfer.bench.throughput import make_prompts

RECORDED = Path(__file__).parent / "data" / "llamacpp_peer_child.json"
HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


_args = peer_args


@pytest.fixture
def ckpt(tmp_path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 32000}))
    (d / "model.safetensors").write_bytes(b"\x01" * 1000)
    (d / "tokenizer.json").write_text("{}")
    return d


@pytest.fixture
def converter(tmp_path) -> Path:
    d = tmp_path / "llama.cpp"
    for sub in ("gguf-py", "conversion"):
        (d / sub).mkdir(parents=True)
    (d / "convert_hf_to_gguf.py").write_text("")
    return d / "convert_hf_to_gguf.py"


@pytest.mark.skipif(HAVE_LLAMA_CPP, reason="llama_cpp is importable here")
def test_detect_without_and_with_a_bad_python(tmp_path):
    assert lp.detect(None) == {"peer": "llamacpp", "status": "not installed"}
    assert peers.detect("llamacpp") == {"peer": "llamacpp", "status": "not installed"}
    with pytest.raises(ValueError, match=r"--llamacpp-python /no/such/python: no executable file there"):
        lp.detect("/no/such/python")
    with pytest.raises(ValueError, match=r"`import llama_cpp` failed there: ModuleNotFoundError"):
        lp.detect(sys.executable)


def test_gguf_type():
    assert [lp.gguf_type(d, None) for d in ("float32", "bfloat16", "float16")] == ["f32", "bf16", "f16"]
    assert lp.gguf_type("float32", "q4_0") == "q4_0"
    with pytest.raises(ValueError, match="--llamacpp-quant takes one of q8_0, q4_0, q4_k_m, got 'q2_k'"):
        lp.gguf_type("float32", "q2_k")
    with pytest.raises(ValueError, match="--dtype 'auto' has no GGUF type"):
        lp.gguf_type("auto", None)


def test_checkpoint_hash_follows_the_files(ckpt):
    h = lp.checkpoint_hash(ckpt)
    assert h == lp.checkpoint_hash(ckpt) and len(h) == 64
    (ckpt / "README.md").write_text("not read by a conversion")
    assert lp.checkpoint_hash(ckpt) == h
    (ckpt / "model.safetensors").write_bytes(b"\x01" * 999 + b"\x02")  # same size, one byte differs
    assert lp.checkpoint_hash(ckpt) != h
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no .safetensors files to convert"):
        lp.checkpoint_hash(ckpt)


def test_convert_steps_skip_what_the_cache_has(ckpt, converter, tmp_path):
    cache, h = tmp_path / "cache", lp.checkpoint_hash(ckpt)
    script = str(Path(lp.__file__).resolve())
    f32, q4 = lp.gguf_path(cache, h, "f32"), lp.gguf_path(cache, h, "q4_0")
    assert f32.name == f"{h[:20]}-f32.gguf"
    steps = lp.convert_commands("/py", str(converter), str(ckpt), cache, h, "float32", "q4_0")
    assert steps == [
        (f32, ["/py", script, "convert", "--converter", str(converter.resolve()), "--model", str(ckpt),
               "--outtype", "f32", "--outfile", str(f32)]),
        (q4, ["/py", script, "quantize", "--input", str(f32), "--type", "q4_0", "--outfile", str(q4)])]
    cache.mkdir()
    f32.write_bytes(b"")
    assert [s[0] for s in lp.convert_commands("/py", None, str(ckpt), cache, h, "float32", "q4_0")] == [q4]
    f32.unlink()
    q4.write_bytes(b"")  # the quantized file alone is enough, and needs no converter
    assert lp.convert_commands("/py", None, str(ckpt), cache, h, "float32", "q4_0") == []
    # Another dtype is another key.
    assert [s[0].name for s in lp.convert_commands("/py", str(converter), str(ckpt), cache, h, "bfloat16",
                                                   None)] == [f"{h[:20]}-bf16.gguf"]
    with pytest.raises(ValueError, match="--llamacpp-converter is required"):
        lp.convert_commands("/py", None, str(ckpt), cache, h, "bfloat16", None)
    (converter.parent / "conversion").rmdir()
    with pytest.raises(ValueError, match="conversion missing beside it"):
        lp.check_converter(str(converter))


def test_spec_carries_the_prompts_a_throughput_child_uses(ckpt):
    args = _args(ckpt, "--batch-sizes", "1,8", "--input-len", "128", "--output-len", "32",
                 "--warmup-iters", "2", "--seed", "3", "--num-threads", "2")
    spec = lp.child_spec(args, "/c/x-f32.gguf", "f32", 8, 32000)
    json.dumps(spec)
    assert spec["schema"] == lp.SPEC_SCHEMA
    assert (spec["batch_size"], spec["n_threads"], spec["gguf"], spec["gguf_type"]) == (8, 2, "/c/x-f32.gguf", "f32")
    assert (spec["mode"], spec["output_len"], spec["decode_steps"]) == ("e2e", 32, None)
    assert spec["warmup_prompt_sets"] == [make_prompts(3, 8, it, 128, 32000, 16) for it in (-1, -2)]
    assert spec["timed_prompts"] == make_prompts(3, 8, 0, 128, 32000, 16)
    with pytest.raises(ValueError, match="greedily only; got --temperature 0.7"):
        lp.child_spec(_args(ckpt, "--temperature", "0.7"), "g", "f32", 1, 32000)


def test_child_command_runs_the_script_standalone(tmp_path):
    cmd = lp.child_command("/venv/bin/python", "s.json", "o.json")
    script = str(Path(lp.__file__).resolve())
    assert cmd == ["/venv/bin/python", script, "run", "--spec", "s.json", "--output-json", "o.json"]
    # -S -I: only the standard library is importable, as in a llama-cpp-python venv without openinfer.
    proc = subprocess.run([sys.executable, "-S", "-I", script, "run", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--spec" in proc.stdout, proc.stderr
    bad = tmp_path / "spec.json"
    bad.write_text(json.dumps({"schema": "other"}))
    proc = subprocess.run([sys.executable, "-S", "-I", script, "run", "--spec", str(bad), "--output-json",
                           str(tmp_path / "o.json")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "schema 'other'" in proc.stderr


def test_child_env_gets_openinfers_malloc_settings(monkeypatch):
    from openinfer import platform as cpu_malloc

    assert lp.child_env({"PATH": "/bin"}) == {"PATH": "/bin", **cpu_malloc.MALLOC_ENV}
    assert lp.child_env({"MALLOC_TOP_PAD_": "0"})["MALLOC_TOP_PAD_"] == "0"  # the caller's own wins
    monkeypatch.setenv("OPENINFER_MALLOC_TUNING", "0")
    assert lp.child_env({}) == {}


def test_cli_stops_on_a_bad_llamacpp_python_before_running_anything(tmp_path):
    cmd = [sys.executable, "-m", "openinfer", "bench", "peers", "--peers", "llamacpp", "--llamacpp-python",
           "/no/such/python", "--batch-sizes", "1", "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: --llamacpp-python /no/such/python: no executable file there" in proc.stderr
    assert "---" not in proc.stdout and not (tmp_path / "out").exists()


def test_recorded_child_json_merges_into_the_report(tmp_path):
    child = lp.read_child(RECORDED)
    eng, s = child["engine"], child["sample"]
    assert eng["llama_cpp_python"] == "0.3.36" and eng["gguf_type"] == "f32" and eng["init_time_s"] > 0
    batch = eng["n_seq_max"]
    assert batch == 8 and s["num_input_tokens"] == batch * 128 and s["num_output_tokens"] == batch * 32
    assert len(child["first_output_token_ids"]) == 32 and s["mean_ttft_s"] < s["elapsed_s"]

    fields = R.IterationSample.__dataclass_fields__
    sample = R.IterationSample(**{k: v for k, v in s.items() if k in fields})
    ours = R.IterationSample(elapsed_s=s["elapsed_s"] / 2, num_output_tokens=s["num_output_tokens"],
                             num_input_tokens=s["num_input_tokens"], mean_ttft_s=None)
    result = R.new_result(["openinfer", "bench", "peers"], {"load_average": None, "num_devices": 1,
                                                             "torch_num_threads": 2, "device": "cpu"},
                          {"mode": "e2e", "input_len": 128, "output_len": 32, "num_iters": 1, "warmup_iters": 1,
                           "context_len": None, "batch_sizes": [batch], "temperature": 0.0,
                           "speculative_config": None})
    result["engines"]["openinfer"] = {"dtype": "float32"}
    peers._merge_peer_child(result, "llamacpp", child, 1, batch, 0)
    (proc,) = result["engines"]["llamacpp"]["per_process"]
    assert proc["first_output_token_ids"] == child["first_output_token_ids"]
    for engine, smp in (("openinfer", ours), ("llamacpp", sample)):
        R.add_point(result, R.PointResult(engine, batch, 128, 32, 1, samples=[smp]).summary())
    peers.add_peer_ratios(result, ["llamacpp"])
    (point,) = result["points"]
    assert point["llamacpp"]["output_throughput"] == pytest.approx(batch * 32 / s["elapsed_s"])
    assert point["llamacpp"].keys() == point["openinfer"].keys()
    assert point["ratios_openinfer_over"]["llamacpp"]["output_throughput"] == pytest.approx(2.0)
    table = results_table(result)
    assert "llamacpp tok/s" in table and "openinfer / llamacpp" in table and "| 2.00x |" in table
    result["peers"] = [{"peer": "llamacpp", "status": "ran", "version": "0.3.36", "checkpoint_sha256": "ab" * 32,
                        "gguf_made": {"x-f32.gguf": {"vocab": "converter"}}}]
    (line,) = _llamacpp_lines(result)
    assert line.startswith("- llama.cpp engine: llama-cpp-python 0.3.36") and "one llama_decode per step" in line
    assert "checkpoint sha256 abababababababababab; x-f32.gguf: {'vocab': 'converter'}" in line

    bad = tmp_path / "bad.json"
    for broken, msg in (({"schema": "x"}, "not a llamacpp_peer result"),
                        ({"sample": dict(s, elapsed_s=0)}, "non-positive elapsed_s")):
        bad.write_text(json.dumps(dict(json.loads(RECORDED.read_text()), **broken)))
        with pytest.raises(ValueError, match=msg):
            lp.read_child(bad)
