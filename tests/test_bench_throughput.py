"""``openinfer bench throughput``: the command runs end to end and its JSON is complete and self-consistent.

Speed is not checked (the machine is shared); structure, token accounting and ratios are.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import make_dense_checkpoint
from openinfer.bench import results as R
from openinfer.bench.throughput import make_prompts, sweep
from openinfer.bench.workload import parse_batch_sizes

REPO = Path(__file__).resolve().parents[1]
IN_LEN, OUT_LEN = 8, 8
RATES = ("output_throughput", "total_token_throughput", "requests_per_second")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_dense_checkpoint(tmp_path_factory.mktemp("bench"), "llama")


def run_bench(ckpt: Path, out: Path, *extra: str, expect_table: str = "Throughput, input 8 / output 8",
              lengths: tuple[str, ...] = ("--input-len", str(IN_LEN), "--output-len", str(OUT_LEN))) -> dict:
    cmd = [sys.executable, "-m", "openinfer", "bench", "throughput", "--model", str(ckpt), *lengths,
           "--num-iters", "1", "--output-json", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert expect_table in proc.stdout  # the table was printed
    return json.loads(out.read_text())


def check_summary(s: dict, engine: str, batch: int) -> None:
    assert s["engine"] == engine and s["batch_size"] == batch == s["num_requests"]
    assert s["total_input_tokens"] == batch * IN_LEN
    assert s["total_output_tokens"] == batch * OUT_LEN
    assert s["total_num_tokens"] == batch * (IN_LEN + OUT_LEN)
    assert s["num_iters"] == len(s["elapsed_times"]) == 1
    assert s["elapsed_time"] > 0
    for k in RATES:
        assert s[k] > 0 and s[f"{k}_min"] <= s[k] <= s[f"{k}_max"]
        assert s[f"{k}_per_device"] == pytest.approx(s[k] / s["num_devices"])
    assert s["output_throughput"] == pytest.approx(batch * OUT_LEN / s["elapsed_time"])
    assert s["total_token_throughput"] == pytest.approx(batch * (IN_LEN + OUT_LEN) / s["elapsed_time"])
    assert s["requests_per_second"] == pytest.approx(batch / s["elapsed_time"])
    assert s["mean_ttft_ms"] is not None and 0 < s["mean_ttft_ms"] <= 1000 * s["elapsed_time"]
    assert s["cached_prompt_tokens"] == 0  # distinct prompts: a prefix-cache hit would inflate throughput


@pytest.mark.slow  # bench subprocesses, each importing torch and building an engine
def test_sweep_vs_hf_json(ckpt, tmp_path):
    d = run_bench(ckpt, tmp_path / "r.json", "--batch-sizes", "1,2,4", "--vs", "hf", "--hf-max-batch", "2")
    assert d["schema"] == R.SCHEMA
    env = d["environment"]
    assert env["num_devices"] == 1 and env["torch_num_threads"] >= 1 and env["cpu_model"]
    assert env["torch"] and env["transformers"] and env["device"] == "cpu"
    assert env["model"]["num_params"] > 0 and env["model"]["architecture"] == "LlamaForCausalLM"
    w = d["workload"]
    assert (w["input_len"], w["output_len"], w["batch_sizes"]) == (IN_LEN, OUT_LEN, [1, 2, 4])
    assert w["ignore_eos"] is True and w["temperature"] == 0 and "prefix" in w["prompts"]
    assert d["engines"]["openinfer"]["dtype"] == d["engines"]["hf"]["dtype"] == "bfloat16"
    assert "KV cache" in d["engines"]["openinfer"]["startup_message"]
    assert [p["batch_size"] for p in d["points"]] == [1, 2, 4]
    *both, beyond = d["points"]
    check_summary(beyond["openinfer"], "openinfer", 4)
    assert beyond["hf"] is None and beyond["ratio_openinfer_over_hf"] is None  # beyond --hf-max-batch
    assert any("hf-max-batch" in n for n in d["notes"])
    for p in both:
        b = p["batch_size"]
        check_summary(p["openinfer"], "openinfer", b)
        check_summary(p["hf"], "hf", b)
        for k in RATES:
            assert p["ratio_openinfer_over_hf"][k] == pytest.approx(p["openinfer"][k] / p["hf"][k])
            assert math.isfinite(p["ratio_openinfer_over_hf"][k]) and p["ratio_openinfer_over_hf"][k] > 0


@pytest.mark.slow  # two child processes, each importing torch and building an engine
def test_fresh_process_merges(ckpt, tmp_path):
    """One child process per point, merged (HF in fresh processes: test_bench_peers.py; --hf-max-batch: above)."""
    d = run_bench(ckpt, tmp_path / "r.json", "--batch-sizes", "1,2", "--warmup-iters", "0", "--fresh-process")
    assert d["workload"]["fresh_process"] is True
    one, two = d["points"]
    check_summary(one["openinfer"], "openinfer", 1)
    check_summary(two["openinfer"], "openinfer", 2)
    runs = d["engines"]["openinfer"]["per_process"]
    assert [r["batch_size"] for r in runs] == [1, 2]
    # Children build the engine the single-process run would: sized for the largest batch of the sweep.
    assert d["engines"]["openinfer"]["max_num_seqs"] == 2


def test_prompts_are_seeded_and_distinct():
    a = make_prompts(0, 8, 0, 20, 256)
    assert a == make_prompts(0, 8, 0, 20, 256)  # every engine gets the same prompts
    assert a != make_prompts(0, 8, 1, 20, 256)  # every iteration gets new ones
    assert all(len(p) == 20 and all(0 <= t < 256 for t in p) for p in a)
    assert len({tuple(p[:16]) for p in a}) == 8  # no shared first KV block
    with pytest.raises(ValueError):
        make_prompts(0, 8, 0, 1, 3)  # 3 possible one-token prompts cannot make 8 distinct ones


def test_prompts_with_a_shared_prefix():
    a = make_prompts(0, 8, 0, 40, 256, 16, shared_prefix_len=24)
    assert all(len(p) == 40 and p[:24] == a[0][:24] for p in a)
    assert len({tuple(p[24:40]) for p in a}) == 8  # the tails' first blocks differ
    b = make_prompts(0, 4, 1, 40, 256, 16, shared_prefix_len=24)
    assert b[0][:24] == a[0][:24] and b[0][24:] != a[0][24:]  # one prefix per sweep, new tails per iteration


def test_decode_window_shared_prefix_and_speculative_steps(ckpt):
    """--shared-prefix-len: the batch hits the primed prefix in the prefix cache; with speculative decoding a
    timed step adds 1..1+k tokens to each request and all are counted, with the window's drafts. The tokens are
    the plain greedy run's (a draft model equal to the target accepts every draft)."""
    from openinfer.bench.throughput import OpenInferRunner
    from openinfer.bench.workload import resolve_workload

    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 2, "model": str(ckpt)})
    common = ("--model", str(ckpt), "--dtype", "float32", "--mode", "decode", "--context-len", str(CTX),
              "--batch-sizes", "3")
    args = parse(*common, "--decode-steps", str(STEPS), "--shared-prefix-len", "16", "--speculative-config", spec)
    resolve_workload(args)
    runner = OpenInferRunner(args, 3)
    prompts = make_prompts(0, 3, 0, CTX, runner.vocab_size, runner.block_size, 16)
    sample = runner.run_decode(prompts, STEPS)
    assert sample.cached_prompt_tokens == 3 * 16  # every request hit the primed block
    drafts, drafted, accepted = sample.spec_drafts
    assert drafts == 3 * STEPS and drafted == accepted == 2 * drafts  # one verification per request per step
    win = runner.last_window
    assert [len(t) for t in win.tokens] == [3 * STEPS] * 3
    assert sample.num_output_tokens == 9 * STEPS
    runner.close()

    plain = parse(*common, "--decode-steps", str(3 * STEPS))
    resolve_workload(plain)
    ref = OpenInferRunner(plain, 3)
    ref.run_decode(prompts, 3 * STEPS)
    assert ref.last_window.tokens == win.tokens and ref.last_window.start_index == win.start_index
    ref.close()


class FakeRunner:
    name = "openinfer"

    def __init__(self) -> None:
        self.prompt_sets: list[list[list[int]]] = []

    def run(self, prompts, output_len):
        self.prompt_sets.append(prompts)
        return R.IterationSample(elapsed_s=1.0, num_output_tokens=len(prompts) * output_len,
                                 num_input_tokens=len(prompts) * IN_LEN)


@pytest.mark.parametrize("batches, expected", [
    # sweep warm-up at 4, which is the largest point's warm-up too; then the others: 1 warm-up + 2 timed
    ([1, 4], [4, 4, 4, 1, 1, 1]),
    ([1, 2, 4], [4, 4, 4, 2, 2, 2, 1, 1, 1]),
    ([4], [4, 4, 4]),  # a one-point child: the sweep warm-up already ran at this batch
])
def test_sweep_warmup_schedule(batches, expected):
    args = argparse.Namespace(seed=0, input_len=IN_LEN, output_len=OUT_LEN, warmup_iters=1, num_iters=2,
                              mode="e2e", context_len=IN_LEN, decode_steps=None)
    runner = FakeRunner()
    summaries = sweep(runner, batches, args, vocab_size=256, block_size=16)
    assert [len(p) for p in runner.prompt_sets] == expected
    assert len({tuple(map(tuple, p)) for p in runner.prompt_sets}) == len(expected)  # never the same prompts
    assert [s["batch_size"] for s in summaries] == batches


def test_parse_batch_sizes():
    assert parse_batch_sizes("32,1, 8,8") == [1, 8, 32]
    for bad in ("", "0,1", "a"):
        with pytest.raises(ValueError):
            parse_batch_sizes(bad)


def test_summary_median_and_spread():
    p = R.PointResult("openinfer", 2, 4, 10, num_devices=2)
    for t in (1.0, 2.0, 4.0):
        p.samples.append(R.IterationSample(elapsed_s=t, num_output_tokens=20, num_input_tokens=8))
    s = p.summary()
    assert s["elapsed_time"] == 2.0 and s["output_throughput"] == 10.0
    assert (s["output_throughput_min"], s["output_throughput_max"]) == (5.0, 20.0)
    assert s["output_throughput_per_device"] == 5.0 and s["mean_ttft_ms"] is None
    assert s["total_token_throughput"] == 14.0 and s["requests_per_second"] == 1.0


# -- decode mode, --num-devices, --speculative-config, workload validation ---------------------------------

CTX, STEPS = 24, 6


def parse(*argv: str) -> argparse.Namespace:
    from openinfer.bench.throughput import add_args

    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(list(argv))


@pytest.mark.slow  # bench subprocesses, each importing torch and building an engine
def test_decode_mode_json_and_num_devices(ckpt, tmp_path):
    d = run_bench(ckpt, tmp_path / "r.json", "--mode", "decode", "--batch-sizes", "1,3", "--vs", "hf",
                  "--dtype", "float32", "--num-devices", "2",
                  lengths=("--context-len", str(CTX), "--decode-steps", str(STEPS)),
                  expect_table="Decode throughput, context 24 tokens, 6 timed decode steps")
    w = d["workload"]
    assert (w["mode"], w["context_len"], w["decode_steps"], w["input_len"]) == ("decode", CTX, STEPS, CTX)
    assert w["output_len"] is None and w["speculative_config"] is None and w["num_devices"] == 2
    assert d["environment"]["num_devices"] == 2  # an explicit --num-devices wins over the engine's ranks
    for p in d["points"]:
        b = p["batch_size"]
        for engine in ("openinfer", "hf"):
            s = p[engine]
            assert (s["mode"], s["context_len"], s["decode_steps"]) == ("decode", CTX, STEPS)
            assert s["total_output_tokens"] == b * STEPS and s["total_input_tokens"] == 0
            # The whole batch prefills in one step here, so every request starts the window at the context.
            assert s["kv_context_min"] == s["kv_context_max"] == CTX
            assert s["output_throughput"] == pytest.approx(b * STEPS / s["elapsed_time"])
            assert s["mean_ttft_ms"] is None and s["num_preemptions"] == 0
            assert s["num_devices"] == 2
            for k in RATES:
                assert s[f"{k}_per_device"] == pytest.approx(s[k] / 2)


def test_decode_window_steps_and_greedy_parity_with_hf(ckpt):
    """Exactly K timed engine steps, batch*K tokens, and the window's tokens equal HF's manual greedy loop
    on the same prompts: both timing loops decode what they claim to."""
    import torch

    from openinfer.bench.hf_peer import HFRunner
    from openinfer.bench.throughput import OpenInferRunner
    from openinfer.bench.workload import resolve_workload

    args = parse("--model", str(ckpt), "--dtype", "float32", "--mode", "decode", "--context-len", str(CTX),
                 "--decode-steps", str(STEPS), "--batch-sizes", "3")
    resolve_workload(args)
    runner = OpenInferRunner(args, 3)
    prompts = make_prompts(0, 3, 0, CTX, runner.vocab_size)
    engine = runner.engine
    calls = []
    real_step = engine.step
    engine.step = lambda: calls.append(1) or real_step()
    sample = runner.run_decode(prompts, STEPS)
    assert len(calls) == 1 + STEPS  # one prefill step (3 x 24 tokens fit one step), then exactly K
    assert sample.num_output_tokens == 3 * STEPS and sample.num_input_tokens == 0
    win = runner.last_window
    assert win.start_index == [1, 1, 1] and [len(t) for t in win.tokens] == [STEPS] * 3
    assert not engine.has_unfinished_requests()  # the requests were aborted, their blocks freed
    assert engine.core.kv.all_free()

    hf = HFRunner(str(ckpt), torch.float32)
    hf_sample = hf.run_decode(prompts, STEPS)
    assert hf_sample.num_output_tokens == 3 * STEPS
    assert hf.last_window_tokens == win.tokens


def test_speculative_config_recorded_or_rejected():
    from openinfer.bench.workload import resolve_workload

    args = parse("--speculative-config", "null")
    resolve_workload(args)
    assert args.speculative_config_value is None
    args = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}')
    resolve_workload(args)  # the engine's own setting, recorded with the workload
    assert args.speculative_config_value["method"] == "ngram"
    assert args.speculative_config_value["num_speculative_tokens"] == 4
    with pytest.raises(ValueError, match="--speculative-config: speculative_config must be JSON"):
        resolve_workload(parse("--speculative-config", "{bad"))
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, 16\], got 0"):
        resolve_workload(parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'))


@pytest.mark.parametrize("argv, message", [
    (["--mode", "decode", "--context-len", "0"], "--context-len must be >= 1, got 0"),
    (["--mode", "decode", "--decode-steps", "0"], "--decode-steps must be >= 1, got 0"),
    (["--num-devices", "0"], "--num-devices must be >= 1, got 0"),
    (["--mode", "decode", "--context-len", "100", "--decode-steps", "27", "--max-model-len", "128"],
     r"--context-len 100 \+ --decode-steps 27 \+ 2 = 129 exceeds --max-model-len 128"),
    (["--mode", "decode", "--context-len", "100", "--decode-steps", "30", "--max-model-len", "128"],
     r"exceeds --max-model-len 128"),
    (["--input-len", "100", "--output-len", "29", "--max-model-len", "128"],
     r"--input-len 100 \+ --output-len 29 = 129 exceeds --max-model-len 128"),
    (["--input-len", "16", "--context-len", "8"], "--context-len 8 and --input-len 16 disagree"),
    (["--mode", "decode", "--output-len", "8"], "--output-len applies to --mode e2e"),
    (["--decode-steps", "8"], "--decode-steps applies to --mode decode"),
    (["--shared-prefix-len", "8"], "--shared-prefix-len applies to --mode decode"),
    (["--mode", "decode", "--context-len", "16", "--shared-prefix-len", "16"],
     r"--shared-prefix-len must be in \[0, --context-len 16\), got 16"),
    (["--mode", "decode", "--context-len", "100", "--decode-steps", "10", "--max-model-len", "128",
      "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
     r"--decode-steps 10 x 3 \(1 \+ num_speculative_tokens\) \+ 2 = 132 exceeds --max-model-len 128"),
])
def test_workload_flags_rejected(argv, message):
    from openinfer.bench.workload import resolve_workload

    with pytest.raises(ValueError, match=message):
        resolve_workload(parse(*argv))


def test_workload_limits_accepted_at_the_boundary():
    from openinfer.bench.workload import resolve_workload

    args = parse("--mode", "decode", "--context-len", "100", "--decode-steps", "26", "--max-model-len", "128")
    resolve_workload(args)
    assert (args.input_len, args.context_len, args.decode_steps, args.output_len) == (100, 100, 26, None)
    args = parse("--context-len", "20")  # e2e: --context-len sets the prompt length
    resolve_workload(args)
    assert (args.input_len, args.output_len, args.decode_steps) == (20, 128, None)


@pytest.mark.slow  # bench subprocesses, each importing torch and building an engine
def test_speculative_run_reports_acceptance(ckpt, tmp_path):
    """--speculative-config runs for real: the JSON records the config and each point's drafts and acceptance (a
    draft identical to the target accepts every draft)."""
    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 2, "model": str(ckpt)})
    res = run_bench(ckpt, tmp_path / "spec.json", "--batch-sizes", "1,2", "--warmup-iters", "0",
                    "--speculative-config", spec)
    assert res["workload"]["speculative_config"]["method"] == "draft_model"
    for p in res["points"]:
        s = p["openinfer"]
        check_summary(s, "openinfer", p["batch_size"])
        assert s["spec_num_drafts"] > 0 and s["spec_num_draft_tokens"] >= s["spec_num_drafts"]
        assert s["spec_acceptance_rate"] == 1.0 and s["spec_mean_accepted_length"] > 2.0


def test_model_info_reads_a_nested_text_config(tmp_path):
    """DeepSeek-V4.1's config.json nests the language model's fields under text_config."""
    from openinfer.bench.results import model_info
    from helpers import load_script

    path = load_script("make_deepseek_v41_checkpoint").make_checkpoint(tmp_path / "v41", "tiny", quantize=False)
    info = model_info(str(path))
    assert info["architecture"] == "DeepseekV41ForCausalLM"
    assert (info["vocab_size"], info["hidden_size"], info["num_hidden_layers"]) == (256, 128, 8)
    assert info["num_params"] > 0 and info["checkpoint_dtype"] == "float32"
