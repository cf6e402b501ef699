"""What differs between devices, in one place: CPU features, free memory, malloc tuning, device sync.

Everything else asks here instead of probing on its own, so a new device kind (or a CPU quirk) is handled once.
torch is imported lazily: the configs and the pure-Python engine import this module without it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# -- CPU features --------------------------------------------------------------------------------------------

# CPU flags that give bf16 matmuls native hardware (else oneDNN emulates them, ~3x slower than fp32).
FAST_BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ("unknown", {}) where there is none."""
    model, flags = "unknown", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == "unknown":
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def cpu_has_fast_bf16() -> bool:
    return bool(cpu_info()[1] & FAST_BF16_CPU_FLAGS)


# -- devices -------------------------------------------------------------------------------------------------

def resolve_device(device: str | None) -> torch.device:
    """``None`` / "auto": CUDA when present, else CPU; an explicit device must exist."""
    import torch

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available on this machine")
    return dev


def available_memory_bytes(device: torch.device) -> int:
    """Free device memory (CUDA), or the host's MemAvailable (CPU; 8 GiB when /proc/meminfo is unreadable)."""
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def total_memory_bytes(device: torch.device) -> int:
    """The device's whole memory (CUDA), or the host's MemTotal (CPU; 8 GiB when /proc/meminfo is unreadable)."""
    if device.type == "cuda":
        import torch

        _, total = torch.cuda.mem_get_info(device)
        return int(total)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def peak_memory_in_use_bytes(device: torch.device) -> int:
    """What this process has used at its peak so far: torch's peak reservation on a GPU (weights and the
    warm-up's activations), the peak resident set on CPU."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_reserved(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (a no-op on CPU, where every op has finished when it returns)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def empty_cache(device: torch.device) -> None:
    """Hand cached allocator blocks back to the device, so free memory measured next is what is really free."""
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


# -- malloc (CPU) --------------------------------------------------------------------------------------------
# Keep large freed buffers in the process (glibc malloc), so a model step does not page-fault its activations.
#
# glibc serves allocations above ``M_MMAP_THRESHOLD`` (at most 32 MB by default) with a fresh ``mmap`` and returns
# them to the OS on free, and trims the heap top above ``M_TRIM_THRESHOLD``. A forward pass allocates and frees
# the same large activations every step, so each step page-faults and zero-fills them anew: on the 2-vCPU Xeon a
# DeepSeek-V4 bench prefill of 32 x 128 tokens took 5.0 s with the defaults and 3.1 s with large buffers kept
# (the settings below, as MALLOC_* environment variables). This is what vLLM's CPU backend gets by preloading
# tcmalloc; openinfer sets glibc's own knobs at start-up instead. ``OPENINFER_MALLOC_TUNING=0`` leaves malloc
# alone (the cost: the process keeps its peak heap instead of returning it to the OS). Benchmarks give every peer
# the same settings (the HF runner calls ``tune_malloc``, the vLLM child gets ``MALLOC_ENV``), since HF gains from
# them as much as openinfer does.

# glibc's environment variable for each knob -> (its mallopt parameter number from malloc.h, the value)
_MALLOC_SETTINGS = {
    "MALLOC_MMAP_THRESHOLD_": (-3, 1 << 30),  # allocations up to 1 GiB come from the heap, not a fresh mmap
    "MALLOC_TRIM_THRESHOLD_": (-1, (1 << 31) - 1),  # never hand the heap top back to the OS
    "MALLOC_TOP_PAD_": (-2, 256 << 20),  # grow the heap 256 MB at a time
}
# The same settings as environment variables, for child processes openinfer does not run in (vllm_peer).
MALLOC_ENV = {name: str(value) for name, (_, value) in _MALLOC_SETTINGS.items()}


def malloc_tuning_enabled() -> bool:
    from openinfer import envs

    return envs.MALLOC_TUNING


@functools.cache
def tune_malloc() -> bool:
    """Apply the settings once per process; returns whether glibc accepted them (False off glibc, or when
    turned off)."""
    if not malloc_tuning_enabled():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = all([libc.mallopt(param, value) == 1 for param, value in _MALLOC_SETTINGS.values()])  # try every one
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        ok = False
    logger.debug("malloc tuning %s", "applied" if ok else "unavailable")
    return ok
