"""``openinfer bench peers``: alternating fresh-process runs merged into one JSON, a PNG and a markdown table.

Speed is not checked (the machine is shared); structure, accounting, peer status and the written files are.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import make_dense_checkpoint, peer_args
from openinfer.bench import results as R
from openinfer.bench.peers import check_weights, parse_peers, sample_of

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_dense_checkpoint(tmp_path_factory.mktemp("peers"), "llama")


@pytest.mark.slow  # a bench subprocess that runs HF and openinfer
def test_peers_hf_and_missing_vllm(ckpt, tmp_path):
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "openinfer", "bench", "peers", "--model", str(ckpt), "--peers", "hf,vllm",
           "--dtype", "float32", "--batch-sizes", "1,2", "--input-len", "8", "--output-len", "4",
           "--num-iters", "1", "--warmup-iters", "0", "--output-dir", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = json.loads((out / "peers.json").read_text())
    assert d["schema"] == R.SCHEMA and d["workload"]["mode"] == "e2e"
    status = {s["peer"]: s["status"] for s in d["peers"]}
    assert status["hf"] == "ran"
    if importlib.util.find_spec("vllm") is None:
        assert status["vllm"] == "not installed"
        assert "vllm" not in d["engines"]  # no numbers for an engine that did not run
    # Alternating fresh processes: openinfer, hf, openinfer, hf.
    order = sorted((r["run_index"], e) for e in ("openinfer", "hf") for r in d["engines"][e]["per_process"])
    assert [e for _, e in order] == ["openinfer", "hf", "openinfer", "hf"]
    assert [p["batch_size"] for p in d["points"]] == [1, 2]
    for p in d["points"]:
        b = p["batch_size"]
        for e in ("openinfer", "hf"):
            s = p[e]
            assert s["num_iters"] == 1
            assert s["total_output_tokens"] == b * 4 and s["total_input_tokens"] == b * 8
            assert s["output_throughput"] == pytest.approx(b * 4 / s["elapsed_time"])
        ratio = p["ratios_openinfer_over"]["hf"]["output_throughput"]
        assert ratio == pytest.approx(p["openinfer"]["output_throughput"] / p["hf"]["output_throughput"])
        assert p["ratio_openinfer_over_hf"]["output_throughput"] == pytest.approx(ratio)

    png = out / "throughput.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(str(png)).shape[0] > 100  # decodes as an image

    md = (out / "README.md").read_text()
    assert "| batch | openinfer tok/s | hf tok/s | openinfer / hf |" in md
    for p in d["points"]:
        o, h = p["openinfer"]["output_throughput"], p["hf"]["output_throughput"]
        assert f"| {p['batch_size']} | {o:.1f} (" in md and f"| {h:.1f} (" in md
        assert f"| {p['ratios_openinfer_over']['hf']['output_throughput']:.2f}x |" in md
    assert "| vllm | not installed |" in md or importlib.util.find_spec("vllm") is not None
    assert "![throughput vs batch size](throughput.png)" in md
    assert "## What this does and does not show" in md and d["environment"]["torch"] in md


def test_parse_peers():
    assert parse_peers("vllm, hf,vllm") == ["vllm", "hf"]
    for bad in ("", "hf,tgi"):
        with pytest.raises(ValueError, match="--peers takes a comma-separated subset of hf, vllm"):
            parse_peers(bad)


def test_quantization_must_reach_every_engine(ckpt):
    """--quantization quantises openinfer alone: refused beside vLLM / HF (they would run the plain weights) and
    beside llama.cpp unless its GGUF is quantized too; what each engine ran goes into the report."""
    for peers in (["hf"], ["vllm", "llamacpp"]):
        with pytest.raises(ValueError, match="--quantization int8 quantises openinfer's weights only"):
            check_weights(peer_args(ckpt, "--quantization", "int8"), peers)
    with pytest.raises(ValueError, match="needs --llamacpp-quant"):
        check_weights(peer_args(ckpt, "--quantization", "int4"), ["llamacpp"])
    got = check_weights(peer_args(ckpt, "--quantization", "int8", "--llamacpp-quant", "q8_0"), ["llamacpp"])
    assert got == {"openinfer_quantization": "int8", "checkpoint_quantization": None, "llamacpp_quant": "q8_0"}
    assert check_weights(peer_args(ckpt), ["hf", "vllm"]) == {"openinfer_quantization": None,
                                                           "checkpoint_quantization": None, "llamacpp_quant": None}


def test_a_gguf_model_runs_as_it_is_beside_llama_cpp_only(tmp_path):
    """A GGUF --model is what both engines read; peers that cannot read it, or flags that would change its weights
    for one side, are refused by name."""
    from gguf_writer import write_gguf

    from openinfer.bench.peers import _vocab_size, gguf_file_type

    path, _ = write_gguf(tmp_path, "llama", "Q4_1", {"token_embd": "Q8_0"})
    assert check_weights(peer_args(path), ["llamacpp"]) == {
        "openinfer_quantization": None, "checkpoint_quantization": "gguf Q4_1", "llamacpp_quant": None}
    assert gguf_file_type(str(path)) == "Q4_1" and _vocab_size(peer_args(path)) == 263
    with pytest.raises(ValueError, match="--peers hf cannot run it as it is"):
        check_weights(peer_args(path), ["hf", "llamacpp"])
    with pytest.raises(ValueError, match="do not apply to a GGUF --model"):
        check_weights(peer_args(path, "--llamacpp-quant", "q8_0"), ["llamacpp"])


def test_one_iteration_summaries_merge_back_to_the_same_point():
    samples = [R.IterationSample(elapsed_s=t, num_output_tokens=8, num_input_tokens=4, mean_ttft_s=t / 10,
                                 kv_context=(4, 5)) for t in (1.0, 2.0, 4.0)]
    whole = R.PointResult("hf", 2, 2, 4, 1, samples=list(samples)).summary()
    children = [R.PointResult("hf", 2, 2, 4, 1, samples=[s]).summary() for s in samples]
    merged = R.PointResult("hf", 2, 2, 4, 1, samples=[sample_of(c) for c in children]).summary()
    assert merged.keys() == whole.keys()
    for k, v in whole.items():
        assert merged[k] == (pytest.approx(v) if isinstance(v, (int, float, list)) else v), k
    with pytest.raises(ValueError, match="one-iteration"):
        sample_of(whole)
