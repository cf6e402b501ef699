"""One list of engine settings: every ``EngineArgs`` field reaches the engine from ``LLM()``, ``openinfer
generate``, ``openinfer serve``, ``openinfer bench throughput`` (and its ``--fresh-process`` / ``bench peers``
children); bad values are a ``ValueError`` naming the field; ``memory_utilization`` sizes the KV cache.

The entrypoint tests iterate over ``dataclasses.fields(EngineArgs)``: a field an entrypoint misses fails here.
No model is built except in the KV-sizing test (the engine is replaced by a recorder that stops the command).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import openinfer.entrypoints.llm as llm_mod
from helpers import make_dense_checkpoint
from openinfer import LLM
from openinfer.engine_args import EngineArgs, _scalar_type
from openinfer.entrypoints.cli import build_parser, main

FIELDS = dataclasses.fields(EngineArgs)


def sample(f: dataclasses.Field) -> typing.Any:
    """A non-default value of the field's type (derived, so a new field is covered without editing this)."""
    kind = _scalar_type(typing.get_type_hints(EngineArgs)[f.name])
    if kind is bool:
        return not f.default
    if kind is int:  # large enough for the bench's --max-model-len check; a power of two for --block-size
        return 8192 if f.default == 4096 else 4096
    if kind is float:
        return 0.375
    assert kind is str, f"EngineArgs.{f.name}: teach this test to make a {kind} value"
    if f.name == "speculative_config":  # JSON the bench validates before it builds an engine
        return '{"method": "ngram", "num_speculative_tokens": 2}'
    return f"x-{f.name}"


SAMPLES = {f.name: sample(f) for f in FIELDS}


def flags(values: dict[str, typing.Any]) -> list[str]:
    out: list[str] = []
    for name, value in values.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            out.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            out += [f"--{flag}", str(value)]
    return out


def assert_all_fields(got: EngineArgs, entrypoint: str) -> None:
    for f in FIELDS:
        assert getattr(got, f.name) == SAMPLES[f.name], f"{entrypoint} does not pass EngineArgs.{f.name} on"


class Stop(Exception):
    pass


@pytest.fixture
def recorded(monkeypatch) -> list[EngineArgs]:
    """Every engine the entrypoints ask for, recorded instead of built; the command stops there."""
    seen: list[EngineArgs] = []

    def fake_build_engine(engine_args: EngineArgs):
        seen.append(engine_args)
        raise Stop

    monkeypatch.setattr(llm_mod, "build_engine", fake_build_engine)
    return seen


def test_samples_differ_from_defaults():
    for f in FIELDS:
        assert SAMPLES[f.name] != f.default, f.name


def test_llm_takes_every_field(recorded):
    with pytest.raises(Stop):
        LLM(**SAMPLES)
    assert_all_fields(recorded[0], "LLM()")


def test_llm_names_an_unknown_keyword():
    with pytest.raises(TypeError, match=r"'max_model_length' \(did you mean 'max_model_len'\?\)"):
        LLM(max_model_length=128)
    with pytest.raises(TypeError, match="'gpu_memory'"):
        EngineArgs.from_json('{"gpu_memory": 1}')


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_command_takes_every_field(recorded, command):
    with pytest.raises(Stop):
        main([command, *flags(SAMPLES)])
    assert_all_fields(recorded[0], f"openinfer {command}")


def test_bench_throughput_takes_every_field(recorded):
    from openinfer.bench.throughput import OpenInferRunner
    from openinfer.bench.workload import resolve_workload

    args = build_parser().parse_args(["bench", "throughput", *flags(SAMPLES)])
    resolve_workload(args)
    with pytest.raises(Stop):
        OpenInferRunner(args, max_batch=4)
    assert_all_fields(recorded[0], "openinfer bench throughput")


@pytest.mark.parametrize("command", ["throughput", "peers"])
def test_bench_children_get_the_parents_engine_args(command):
    """--fresh-process and bench peers children receive the parent's EngineArgs as JSON."""
    from openinfer.bench.peers import _PARENT_ONLY
    from openinfer.bench.throughput import adopt_parent_engine_args, bench_engine_args, child_argv
    from openinfer.bench.workload import resolve_workload

    extra = ["--output-dir", "unused"] if command == "peers" else []
    parent = build_parser().parse_args(["bench", command, *flags(SAMPLES), *extra])
    resolve_workload(parent)
    cmd = child_argv(parent, 1, 4, "openinfer", "child.json", skip=_PARENT_ONLY if command == "peers" else
                     frozenset())
    assert cmd[1:5] == ["-m", "openinfer", "bench", "throughput"]
    child = build_parser().parse_args(cmd[3:])
    adopt_parent_engine_args(child)
    assert_all_fields(EngineArgs.from_cli_args(child), f"bench {command} -> child")
    assert EngineArgs.from_cli_args(child) == bench_engine_args(parent, 4)


def test_bench_child_gets_the_engine_shape_of_the_whole_sweep():
    """Unset max_num_seqs / max_model_len are sized for the sweep's largest batch, in every child alike."""
    from openinfer.bench.throughput import adopt_parent_engine_args, child_argv
    from openinfer.bench.workload import resolve_workload

    parent = build_parser().parse_args(["bench", "throughput", "--input-len", "8", "--output-len", "8",
                                        "--no-enable-prefix-caching"])
    resolve_workload(parent)
    child = build_parser().parse_args(child_argv(parent, 1, 32, "openinfer", "c.json")[3:])
    adopt_parent_engine_args(child)
    assert (child.max_num_seqs, child.max_model_len, child.enable_prefix_caching) == (32, 16, False)
    assert child.dtype == "bfloat16"  # the bench's own default travels too


# -- the typed config --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_dense_checkpoint(tmp_path_factory.mktemp("ea"), "llama", max_position_embeddings=128)


@pytest.fixture(scope="module")
def ckpt_copy(ckpt, tmp_path_factory) -> Path:
    return Path(shutil.copytree(ckpt, tmp_path_factory.mktemp("ea2") / "copy"))


def valid_values(ckpt_copy: Path) -> dict[str, typing.Any]:
    """A valid non-default value per field, for building real configs."""
    return dict(model=str(ckpt_copy), tokenizer=str(ckpt_copy), dtype="float16", device="meta",
                max_model_len=64, max_num_seqs=3, max_num_batched_tokens=100, block_size=32,
                enable_prefix_caching=False, kv_cache_memory_gb=0.5, memory_utilization=0.5, num_kv_blocks=10,
                kv_cache_dtype="fp8", quantization="int8",
                seed=1, attention_backend="reference", kernel_backend="torch", chat_template="{{ messages }}", tensor_parallel_size=2,
                data_parallel_size=2, enable_expert_parallel=True, distributed_executor_backend="mp",
                enable_eplb=True, num_redundant_experts=2, eplb_step_interval=10,
                speculative_config='{"method": "ngram", "num_speculative_tokens": 2}',
                structured_outputs_backend="llguidance", tokenizer_mode="deepseek_v4",
                kv_transfer_config='{"kv_connector": "NixlConnector", "kv_role": "kv_both"}',
                gpu_memory_utilization=0.5, scheduling_policy="priority", generation_config="vllm",
                kv_offloading_size=1.0, kv_offloading_path=str(ckpt_copy.parent / "kv_tier"),
                limit_mm_per_prompt='{"image": 0}', allowed_local_media_path=str(ckpt_copy.parent))


# Fields whose other valid values need an outside service to mean anything (kv_offloading_backend "redis": a shared
# store's URL, reached at engine start): here an unknown value must be refused by name rather than ignored
# (tests/test_kv_tier.py builds engines with "redis").
ONE_CHOICE = {"kv_offloading_backend": ("lmcache", {"kv_offloading_size": 1.0})}


COMPANIONS = {name: {"enable_expert_parallel": True} for name in
              ("enable_eplb", "num_redundant_experts", "eplb_step_interval")}
COMPANIONS["kv_offloading_path"] = {"kv_offloading_size": 1.0}


def test_every_field_reaches_the_engine(ckpt, ckpt_copy, monkeypatch):
    """Changing any one field changes what LLMEngine is built with (its config, or chat_template)."""
    built: list[tuple] = []
    monkeypatch.setattr(llm_mod, "LLMEngine", lambda config, chat_template=None: built.append(
        (config, chat_template)))
    values = valid_values(ckpt_copy)
    missing = {f.name for f in FIELDS} - set(values) - set(ONE_CHOICE)
    assert not missing, f"add a valid non-default value for the new EngineArgs field(s) {missing} here"
    for name, (other, companion) in ONE_CHOICE.items():
        with pytest.raises(ValueError, match=name):
            llm_mod.build_engine(EngineArgs(model=str(ckpt), **companion, **{name: other}))
    for name, value in values.items():
        # A field that is only valid beside another (EPLB needs expert parallelism) is compared with and without
        # itself on top of that companion.
        companion = {"model": str(ckpt), **COMPANIONS.get(name, {})}
        llm_mod.build_engine(EngineArgs(**companion))
        base = built.pop()
        llm_mod.build_engine(EngineArgs(**{**companion, name: value}))
        assert built.pop() != base, f"EngineArgs.{name} does not reach the engine"


def test_max_model_len_has_one_home(ckpt):
    config = EngineArgs(model=str(ckpt), max_model_len=64).create_engine_config()
    assert config.model.max_model_len == 64
    assert not hasattr(config.scheduler, "max_model_len")
    assert config.scheduler.max_num_batched_tokens == 2048  # the default step budget, from the model config
    assert EngineArgs(model=str(ckpt)).create_engine_config().model.max_model_len == 128


@pytest.mark.parametrize("bad, message", [
    (dict(block_size=12), r"block_size must be a positive power of two, got 12"),
    (dict(max_num_seqs=0), r"max_num_seqs must be > 0, got 0"),
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens must be > 0, got 0"),
    (dict(memory_utilization=1.5), r"memory_utilization must be in \(0, 1\], got 1.5"),
    (dict(memory_utilization=0.0), r"memory_utilization must be in \(0, 1\], got 0.0"),
    (dict(kv_cache_memory_gb=-1.0), r"kv_cache_memory_gb must be > 0, got -1.0"),
    (dict(num_kv_blocks=1), r"num_kv_blocks must be >= 2, got 1"),
    (dict(kv_cache_dtype="int8"), r"kv_cache_dtype='int8' is not supported; choose one of auto, fp8"),
    (dict(quantization="fp4"), r"quantization='fp4' is not supported; choose one of int8, int4"),
    (dict(max_model_len=0), r"max_model_len must be > 0, got 0"),
    (dict(max_model_len=1000), r"max_model_len=1000 exceeds the model's max_position_embeddings=128"),
    (dict(dtype="int8"), r"dtype='int8' is not supported"),
    (dict(attention_backend="flash"), r"attention_backend='flash'; choose one of"),
    (dict(kernel_backend="cuda"), r"kernel_backend='cuda'; choose one of auto, cpu, torch"),
    (dict(tensor_parallel_size=0), r"tensor_parallel_size must be an integer >= 1, got 0"),
    (dict(distributed_executor_backend="slurm"), r"distributed_executor_backend='slurm'; choose one of"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), r"'uni' runs one rank"),
    (dict(data_parallel_size=0), r"data_parallel_size must be an integer >= 1, got 0"),
    (dict(enable_eplb=True), r"enable_eplb / num_redundant_experts place experts over expert-parallel ranks"),
    (dict(enable_expert_parallel=True, num_redundant_experts=-1), r"num_redundant_experts must be an integer >= 0"),
    (dict(enable_expert_parallel=True, eplb_step_interval=0), r"eplb_step_interval must be an integer >= 1"),
    (dict(speculative_config='{"method": "medusa", "num_speculative_tokens": 2}'),
     r"speculative_config.method='medusa'; choose one of"),
    (dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 0}'),
     r"num_speculative_tokens must be an integer in \[1, 16\], got 0"),
    (dict(speculative_config='{"method": "ngram", "k": 2}'), r"speculative_config has unknown keys \['k'\]"),
    (dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent"},
          data_parallel_size=2, enable_expert_parallel=True),
     r"method='draft_model' with enable_expert_parallel and data_parallel_size=2 is not supported yet"),
    (dict(structured_outputs_backend="outlines"), r"structured_outputs_backend='outlines'; choose one of"),
    (dict(tokenizer_mode="mistral"), r"tokenizer_mode='mistral'; choose one of auto, deepseek_v4, deepseek_v32"),
])
def test_bad_value_names_the_field_and_limit(ckpt, bad, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(ckpt), **bad).create_engine_config()


def test_bad_value_on_the_command_line_is_one_clear_line(ckpt, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(ckpt), "--memory-utilization", "1.5"])
    assert e.value.code == 2
    assert "error: memory_utilization must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_memory_utilization_sizes_the_kv_cache(ckpt, monkeypatch):
    """Without kv_cache_memory_gb the KV budget is memory_utilization of the free memory: doubling it
    doubles the block count."""
    from openinfer import platform

    free = 1 << 30
    monkeypatch.setattr(platform, "available_memory_bytes", lambda device: free)
    blocks = {}
    for util in (0.001, 0.002):
        llm = LLM(str(ckpt), dtype="float32", device="cpu", max_model_len=64, memory_utilization=util)
        assert llm.engine.config.cache.memory_utilization == util
        blocks[util] = llm.engine.num_kv_blocks["full"]
        bytes_per_block = llm.engine.kv_bytes_per_token * llm.engine.config.cache.block_size
        assert blocks[util] * bytes_per_block <= free * util
        del llm
    assert blocks[0.001] >= 2 and abs(blocks[0.002] - 2 * blocks[0.001]) <= 1


def test_engine_args_import_and_flags_without_torch():
    code = ("import argparse, sys\n"
            "from openinfer.engine_args import EngineArgs\n"
            "p = argparse.ArgumentParser(); EngineArgs.add_cli_args(p)\n"
            "a = EngineArgs.from_cli_args(p.parse_args(['--max-model-len', '64', '--no-enable-prefix-caching']))\n"
            "assert (a.max_model_len, a.enable_prefix_caching) == (64, False), a\n"
            "assert 'torch' not in sys.modules, 'engine_args imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_expert_parallel_ranks_must_divide_the_experts(tmp_path):
    """EP size = TP x DP: more ranks than experts (or a size that splits them unevenly) is a start-up error naming
    the expert count and both parallel sizes, before any worker starts."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from make_deepseek_checkpoint import make_v3

    path = make_v3(tmp_path, "tiny")
    experts = json.loads((Path(path) / "config.json").read_text())["n_routed_experts"]
    for tp, dp in ((1, experts * 2), (2, 3)):
        with pytest.raises(ValueError, match=rf"n_routed_experts={experts} \+ num_redundant_experts=0 over "
                                             rf"tensor_parallel_size={tp} x data_parallel_size={dp}"):
            EngineArgs(model=str(path), tensor_parallel_size=tp, data_parallel_size=dp,
                       enable_expert_parallel=True).create_engine_config()
    EngineArgs(model=str(path), tensor_parallel_size=2, data_parallel_size=2,
               enable_expert_parallel=True).create_engine_config()  # 4 ranks divide them: accepted
