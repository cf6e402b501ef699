"""Keep large freed buffers in the process (glibc malloc), so a model step does not page-fault its activations.

glibc serves allocations above ``M_MMAP_THRESHOLD`` (at most 32 MB by default) with a fresh ``mmap`` and
returns them to the OS on free, and trims the heap top above ``M_TRIM_THRESHOLD``. A forward pass allocates
and frees the same large activations every step, so each step page-faults and zero-fills them anew: on the
2-vCPU Xeon a DeepSeek-V4 bench prefill of 32 x 128 tokens took 5.0 s with the defaults and 3.1 s with large
buffers kept (the settings below, as MALLOC_* environment variables). This is what vLLM's CPU backend gets by
preloading tcmalloc; openinfer sets glibc's own knobs at start-up instead. ``OPENINFER_MALLOC_TUNING=0`` leaves
malloc alone (the cost: the process keeps its peak heap instead of returning it to the OS). Benchmarks give every
peer the same settings (the HF runner calls ``tune_malloc``, the vLLM child gets ``ENV``), since HF gains from
them as much as openinfer does.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

# glibc's environment variable for each knob -> (its mallopt parameter number from malloc.h, the value)
_SETTINGS = {
    "MALLOC_MMAP_THRESHOLD_": (-3, 1 << 30),  # allocations up to 1 GiB come from the heap, not a fresh mmap
    "MALLOC_TRIM_THRESHOLD_": (-1, (1 << 31) - 1),  # never hand the heap top back to the OS
    "MALLOC_TOP_PAD_": (-2, 256 << 20),  # grow the heap 256 MB at a time
}
# The same settings as environment variables, for child processes openinfer does not run in (vllm_peer).
ENV = {name: str(value) for name, (_, value) in _SETTINGS.items()}


def enabled() -> bool:
    return os.environ.get("OPENINFER_MALLOC_TUNING", "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def tune_malloc() -> bool:
    """Apply the settings once per process; returns whether glibc accepted them (False off glibc, or when
    turned off)."""
    if not enabled():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = all([libc.mallopt(param, value) == 1 for param, value in _SETTINGS.values()])  # try every one
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        ok = False
    logger.debug("malloc tuning %s", "applied" if ok else "unavailable")
    return ok
