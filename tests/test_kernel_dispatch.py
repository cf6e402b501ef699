"""One place decides how every op runs (layers/dispatch.py): the typed KernelConfig and its one mapping from the
environment, the decisions per op kind, the start-up report, ``openinfer env``, and loud failures: a broken kernel
build stops ``openinfer generate`` with the compiler's error, ``--kernel-backend torch`` runs and says so."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import make_dense_checkpoint, random_prompts
from openinfer import LLM, SamplingParams
from openinfer.config import EngineConfig, KernelConfig, engine_config_from_json, engine_config_to_json
from openinfer.engine_args import EngineArgs
from openinfer.layers import dispatch
from openinfer.layers.attention import Attention


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "openinfer", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_dense_checkpoint(tmp_path_factory.mktemp("dispatch") / "llama", vocab_size=128, hidden_size=64,
                                 intermediate_size=128)


# -- the config ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("var, value, field, want", [
    ("OPENINFER_CPU_KERNELS", "0", "backend", "torch"),
    ("OPENINFER_CPU_PANELS", "0", "panels", False),
    ("OPENINFER_CPU_GEMV", "off", "gemv", False),
    ("OPENINFER_CPU_PREPACK", "0", "prepack", False),
    ("OPENINFER_DECODE_BLOCKS", "no", "decode_blocks", False),
    ("OPENINFER_CPU_AMX", "false", "amx", False),
    ("OPENINFER_CPU_BF16_DOT", "0", "bf16_dot", False),
    ("OPENINFER_FP8_WEIGHTS", "dequantize", "fp8_weights", "dequantize"),
    ("OPENINFER_MXFP4_EXPERTS", "dequantize", "mxfp4_experts", "dequantize"),
    ("OPENINFER_GGUF_ACTIVATIONS", "fp32", "gguf_activations", "fp32"),
    ("OPENINFER_KERNEL_CFLAGS", "-march=x86-64-v3", "cflags", "-march=x86-64-v3"),
    ("OPENINFER_KERNEL_CACHE", "/tmp/k", "cache_dir", "/tmp/k"),
])
def test_every_kernel_switch_maps_into_the_config(monkeypatch, var, value, field, want):
    default = KernelConfig.from_env()
    monkeypatch.setenv(var, value)
    cfg = KernelConfig.from_env()
    assert getattr(cfg, field) == want and getattr(default, field) != want


def test_kernel_backend_flag_and_its_checks(monkeypatch, ckpt):
    assert EngineArgs(model=str(ckpt), kernel_backend="torch").create_engine_config().kernel.backend == "torch"
    # an explicit backend wins over OPENINFER_CPU_KERNELS=0, which only changes auto
    monkeypatch.setenv("OPENINFER_CPU_KERNELS", "0")
    assert KernelConfig.from_env("cpu").backend == "cpu" and KernelConfig.from_env().backend == "torch"
    with pytest.raises(ValueError, match="kernel_backend='triton'; choose one of auto, cpu, torch"):
        EngineArgs(model=str(ckpt), kernel_backend="triton").create_engine_config()
    monkeypatch.setenv("OPENINFER_FP8_WEIGHTS", "maybe")
    with pytest.raises(ValueError, match="OPENINFER_FP8_WEIGHTS='maybe'"):
        KernelConfig.from_env()


def test_kernel_config_reaches_worker_processes(ckpt):
    """Workers of mp / Ray executors are started from the config's JSON: the kernel settings travel with it (and
    --quantization, which the JSON used to drop: mp workers then loaded the weights unquantised)."""
    cfg = EngineArgs(model=str(ckpt), kernel_backend="torch", quantization="int8").create_engine_config()
    cfg = EngineConfig(**{**cfg.__dict__, "kernel": KernelConfig(backend="torch", panels=False, cflags="-O2")})
    back = engine_config_from_json(engine_config_to_json(cfg))
    assert back.kernel == cfg.kernel and back.model.quantization == "int8"


# -- the decisions ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fast_bf16", [False, True])
def test_one_place_decides_each_weight_path(fast_bf16):
    cpu = torch.device("cpu")
    on = dispatch.KernelSelection(config=KernelConfig(), device_type="cpu", backend="cpu", ops=object(),
                                  fast_bf16=fast_bf16)
    off = dispatch.KernelSelection(config=KernelConfig(backend="torch"), device_type="cpu", backend="torch",
                                   fast_bf16=fast_bf16)
    assert on.panels(cpu, torch.float32) and not off.panels(cpu, torch.float32)
    assert on.panels(cpu, torch.bfloat16) is (not fast_bf16)  # native bf16 keeps oneDNN's AMX / AVX-512 GEMM
    assert off.onednn_prepack(cpu, torch.bfloat16) is fast_bf16
    assert on.gemv_max_rows(torch.float32) == dispatch.GEMV_MAX_M and off.gemv_max_rows(torch.float32) == 0
    assert (on.gemv_max_rows(torch.bfloat16) == float("inf")) is (not fast_bf16)
    assert on.decode_blocks and not off.decode_blocks
    no_panels = dispatch.KernelSelection(config=KernelConfig(panels=False), device_type="cpu", backend="cpu",
                                         ops=object(), fast_bf16=fast_bf16)
    assert not no_panels.panels(cpu, torch.float32) and no_panels.onednn_prepack(cpu, torch.float32)
    kinds = dict(on.implementations(torch.float32))
    assert kinds["linear float32"].startswith("C++ 16-column panel GEMM")
    assert dict(off.implementations(torch.float32))["attention (paged)"].startswith("gather + SDPA")
    gguf_kind = "linear GGUF Q4_0/1, Q5_0/1, Q8_0, Q4/5/6_K"
    assert kinds[gguf_kind].startswith("C++ GGUF block kernels")
    assert dict(off.implementations(torch.float32))[gguf_kind].startswith("torch reference")
    assert not on.panels(torch.device("meta"), torch.float32)  # not the CPU: torch


def test_the_engine_runs_every_step_with_its_own_selection(ckpt, monkeypatch, caplog):
    """kernel_backend='torch' in a process whose environment would pick the kernels: the engine's steps take the
    torch path (the selection made at load is the one in force, not the environment's), with the same greedy
    tokens as the kernels, and the start-up report says so once."""
    used = []
    real = Attention._decode_gather_sdpa
    monkeypatch.setattr(Attention, "_decode_gather_sdpa", lambda *a: used.append(1) or real(*a))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, [7, 12], vocab_size=128)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for backend in ("torch", "auto"):
        used.clear()
        with caplog.at_level("INFO", logger="openinfer"):
            caplog.clear()
            llm = LLM(model=str(ckpt), dtype="float32", num_kv_blocks=32, kernel_backend=backend)
            outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        reports = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels:")]
        assert len(reports) == 1, reports
        if backend == "torch":
            assert used, "the torch backend's decodes must take gather + SDPA"
            assert "backend     torch (--kernel-backend torch)" in reports[0]
        else:
            assert not used, "the kernel backend's decodes must take the C++ kernel"
            assert "C++ paged decode" in reports[0]
    assert outs["torch"] == outs["auto"]


# -- the command line ------------------------------------------------------------------------------------------

@pytest.mark.slow  # two `openinfer generate` processes (~30-60 s on 2 cores)
def test_a_broken_kernel_build_stops_generate_and_the_torch_backend_runs(tmp_path, ckpt):
    """Must-show: a build that cannot compile (-march=no-such-cpu, an empty cache) makes `openinfer generate` exit
    non-zero with one error line naming the kernel build, the compiler's error and the opt-out; with
    `--kernel-backend torch` the same command runs and its start-up report names the torch path."""
    env = {"OPENINFER_KERNEL_CFLAGS": "-march=no-such-cpu", "OPENINFER_KERNEL_CACHE": str(tmp_path / "cache")}
    args = ["generate", "--model", str(ckpt), "--prompt", "ab", "--max-tokens", "3", "--num-kv-blocks", "16"]
    r = _cli(*args, env=env)
    assert r.returncode != 0
    assert "error: the CPU kernel build failed" in r.stderr and "no-such-cpu" in r.stderr, r.stderr[-2000:]
    assert "--kernel-backend torch" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    r = _cli(*args, "--kernel-backend", "torch", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "backend     torch (--kernel-backend torch)" in r.stderr and "not built" in r.stderr, r.stderr[-2000:]
    assert "3 tokens, finish_reason=length" in r.stdout


def test_openinfer_env_prints_the_platform_the_ops_and_versions():
    r = _cli("env", "--dtype", "float32")
    assert r.returncode == 0, r.stderr[-2000:]
    for text in ("kernels:", "platform", "build", "linear float32", "attention (paged)", "decode blocks",
                 "versions:", "torch", "transformers", "environment:"):
        assert text in r.stdout, (text, r.stdout)
    assert dispatch.isa_summary() in r.stdout
    r = _cli("env", "--kernel-backend", "torch")
    assert r.returncode == 0 and "not built: --kernel-backend torch" in r.stdout
