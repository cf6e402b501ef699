"""Every ``OPENINFER_*`` environment variable, read here and nowhere else (after vLLM's ``vllm/envs.py``).

Each variable is a function of the environment read when asked (``envs.CPU_KERNELS``), so a test or a benchmark
that sets one before building an engine sees it take effect. The kernel switches are not read by the layers:
``KernelConfig.from_env`` (config/model.py) maps them into the typed config once, when the engine config is built, and
``layers/dispatch.py`` decides every op's implementation from that config at load.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

_OFF = ("0", "false", "no", "off")


def _flag(name: str, default: bool = True) -> Callable[[], bool]:
    def read() -> bool:
        value = os.environ.get(name)
        if value is None:
            return default
        return value.strip().lower() not in _OFF
    return read


def _str(name: str, default: str | None = None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name, default)


def _float(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        value = os.environ.get(name)
        if value is None or not value.strip():
            return default
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} must be a number") from None
    return read


def _choice(name: str, default: str, choices: tuple[str, ...]) -> Callable[[], str]:
    def read() -> str:
        value = os.environ.get(name, default).strip().lower()
        if value not in choices:
            raise ValueError(f"{name}={value!r}: choose one of {', '.join(choices)}")
        return value
    return read


# name (as ``envs.NAME``) -> reader; the variable is ``OPENINFER_`` + name.
environment_variables: dict[str, Callable[[], Any]] = {
    # -- CPU kernels: mapped into KernelConfig (config/model.py) by KernelConfig.from_env --------------------------
    # 0 = --kernel-backend torch (the C++ kernels are neither built nor used)
    "CPU_KERNELS": _flag("OPENINFER_CPU_KERNELS"),
    # extra compiler flags appended to the kernel build's (later flags win), e.g. -march=x86-64-v3 builds the
    # AVX2 code on an AVX-512 host
    "KERNEL_CFLAGS": _str("OPENINFER_KERNEL_CFLAGS", ""),
    # the kernel build's cache folder (default: torch's extension cache, TORCH_EXTENSIONS_DIR or ~/.cache)
    "KERNEL_CACHE": _str("OPENINFER_KERNEL_CACHE"),
    # a kernel build lock older than this many seconds belongs to a killed build and is removed
    "KERNEL_LOCK_STALE_S": _float("OPENINFER_KERNEL_LOCK_STALE_S", 600.0),
    # 0 = the decode attention kernels keep their vector code where the CPU has AMX tiles
    "CPU_AMX": _flag("OPENINFER_CPU_AMX"),
    # 0 = the bf16 routed-expert kernel keeps its widening FMA code where the build has AVX512-BF16 dot products
    "CPU_BF16_DOT": _flag("OPENINFER_CPU_BF16_DOT"),
    # 0 = no 16-column weight panels (Linear prepacks fp32 for oneDNN; bf16 runs row-major on the gemv kernel)
    "CPU_PANELS": _flag("OPENINFER_CPU_PANELS"),
    # 0 = no small-M gemv kernel on plain weights
    "CPU_GEMV": _flag("OPENINFER_CPU_GEMV"),
    # 0 = no prepacking of linear weights at all (row-major weights)
    "CPU_PREPACK": _flag("OPENINFER_CPU_PREPACK"),
    # 0 = no fused C++ decode blocks (the layers' Python path runs every decode step)
    "DECODE_BLOCKS": _flag("OPENINFER_DECODE_BLOCKS"),
    # 0 = a CPU model's weights stay in the pages they were loaded into (worker/huge_pages.py: else collapsed into
    # 2 MiB transparent huge pages after load)
    "HUGE_PAGES": _flag("OPENINFER_HUGE_PAGES"),
    # packed | dequantize: FP8 block-quantised linears kept packed, or dequantised at load
    "FP8_WEIGHTS": _choice("OPENINFER_FP8_WEIGHTS", "packed", ("packed", "dequantize")),
    # packed | dequantize: MXFP4 routed experts kept packed, or dequantised at load
    "MXFP4_EXPERTS": _choice("OPENINFER_MXFP4_EXPERTS", "packed", ("packed", "dequantize")),
    # auto | int8 | fp32: GGUF linears' activations quantised to int8 per 32 columns with integer dot products, or
    # kept fp32 (auto: int8 where the kernel build has a SIMD integer dot product)
    "GGUF_ACTIVATIONS": _choice("OPENINFER_GGUF_ACTIVATIONS", "auto", ("auto", "int8", "fp32")),
    # -- engine and workers ------------------------------------------------------------------------------------
    # 0 = DeepSeek-V4.1's layers compute every row, also those no later layer reads (to measure the saving)
    "SKIP_UNREAD_ROWS": _flag("OPENINFER_SKIP_UNREAD_ROWS"),
    # seconds worker processes may take to join the process groups and load their shards
    "WORKER_START_TIMEOUT_S": _float("OPENINFER_WORKER_START_TIMEOUT_S", 900.0),
    # seconds Ray may take to place the workers' bundles
    "RAY_PLACEMENT_TIMEOUT_S": _float("OPENINFER_RAY_PLACEMENT_TIMEOUT_S", 300.0),
    # test-only fault injection (engine/fault_inject.py); unset in production
    "FAULT_INJECT": _str("OPENINFER_FAULT_INJECT"),
    # 0 = leave glibc malloc's settings alone (platform.tune_malloc)
    "MALLOC_TUNING": _flag("OPENINFER_MALLOC_TUNING"),
    # -- front end ---------------------------------------------------------------------------------------------
    # the level of openinfer's own logger (INFO by default)
    "LOG_LEVEL": _str("OPENINFER_LOG_LEVEL", "INFO"),
    # the server's API key when --api-key is not given
    "API_KEY": _str("OPENINFER_API_KEY"),
    # the folder of converted GGUF tokenizers (tokenizer_cache.py; default ~/.cache/openinfer/gguf_tokenizers), or off
    "TOKENIZER_CACHE": _str("OPENINFER_TOKENIZER_CACHE"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)


def variable(name: str) -> str:
    """The environment variable behind ``envs.<name>`` (for messages and child-process environments)."""
    if name not in environment_variables:
        raise KeyError(name)
    return "OPENINFER_" + name


_KERNEL_SWITCHES = ("CPU_KERNELS", "KERNEL_CFLAGS", "KERNEL_CACHE", "CPU_AMX", "CPU_BF16_DOT", "CPU_PANELS", "CPU_GEMV",
                    "CPU_PREPACK", "DECODE_BLOCKS", "FP8_WEIGHTS", "MXFP4_EXPERTS", "GGUF_ACTIVATIONS")


def kernel_switches() -> tuple[str | None, ...]:
    """The raw values of the variables ``KernelConfig.from_env`` reads: a cheap key for "did they change"."""
    return tuple(os.environ.get("OPENINFER_" + name) for name in _KERNEL_SWITCHES)


def set_in_environment() -> dict[str, str]:
    """The ``OPENINFER_*`` variables this process has set (``openinfer env`` prints them)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("OPENINFER_")}
