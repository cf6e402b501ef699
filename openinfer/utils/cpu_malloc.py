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
import logging
import os

logger = logging.getLogger(__name__)

# mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

_SETTINGS = ((_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, (1 << 31) - 1), (_M_TOP_PAD, 256 << 20))
_done: list[bool] = []
# The same settings as glibc's environment variables, for child processes openinfer does not run in (vllm_peer).
ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str((1 << 31) - 1),
       "MALLOC_TOP_PAD_": str(256 << 20)}


def enabled() -> bool:
    return os.environ.get("OPENINFER_MALLOC_TUNING", "1").strip().lower() not in ("0", "false", "no", "off")


def tune_malloc() -> bool:
    """Apply the settings once per process; returns whether glibc accepted them (False off glibc, or when
    turned off)."""
    if _done:
        return _done[0]
    ok = False
    if enabled():
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            ok = all([libc.mallopt(param, value) == 1 for param, value in _SETTINGS])  # try every one
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
            ok = False
        logger.debug("malloc tuning %s", "applied" if ok else "unavailable")
    _done.append(ok)
    return ok
