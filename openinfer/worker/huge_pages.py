"""A loaded model's weights moved into transparent huge pages (CPU, Linux), once, after load.

Why: a CPU decode step streams every weight once, and at small batch that read is the step. With 4 KiB pages a
135 MB model is ~33,000 pages, a TLB miss every 4 KiB of the stream; with 2 MiB pages, 68. Measured on the Llama
bench checkpoint's Q4_K_M GGUF (2-core AVX-512 EPYC, 2 threads, batch 1, 6 fresh processes each way, alternating):
decode step 5.84-6.65 ms with the weights collapsed into huge pages against 6.25-8.03 ms without, the slow end
being processes whose pages happened to fall badly. llama.cpp gets the same from the page cache, whose large folios
back its mmap-ed file.

How: ``MADV_COLLAPSE`` (Linux 6.1+) on the whole huge pages the weights span (``huge_page_spans``), which copies
the resident small pages into huge ones synchronously (~1 s per GB), whatever the system's THP mode short of
``never``, plus ``MADV_HUGEPAGE`` so the range stays eligible. A kernel or mode that refuses is no error: the weights
stay where they are. Only weights: the KV cache is allocated
and zeroed by each model's ``bind_kv_cache``, and collapsing gigabytes of it would cost seconds at every start.
``OPENINFER_HUGE_PAGES=0`` turns this off.
"""
from __future__ import annotations

import ctypes
import logging
import sys
import time
from typing import Iterable, Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20
MIN_STORAGE = 64 << 10  # smaller storages (norms, biases) are too few bytes to matter


def _tensors(obj, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors held by a module's attributes: directly, in lists / tuples / dicts, or one or two objects down (a
    quantized weight's data and parts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 2:
        return
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
        for x in vars(obj).values():
            yield from _tensors(x, depth + 1)


def weight_ranges(modules: Iterable[nn.Module], min_bytes: int = MIN_STORAGE) -> list[tuple[int, int]]:
    """The (start, end) address ranges of the CPU storages the modules hold (parameters, buffers and tensors kept in
    attributes), each at least ``min_bytes``, deduplicated, in address order."""
    seen: dict[int, int] = {}
    for root in modules:
        for m in root.modules():
            ts = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
            ts += [t for k, v in vars(m).items() if k not in ("_parameters", "_buffers", "_modules")
                   for t in _tensors(v)]
            for t in ts:
                if t.device.type != "cpu" or t.layout != torch.strided or t.is_mkldnn:
                    continue  # oneDNN's prepacked weights are opaque: no storage to point at
                try:
                    storage = t.untyped_storage()
                    ptr, n = storage.data_ptr(), storage.nbytes()
                except (RuntimeError, NotImplementedError):  # other opaque tensors
                    continue
                if n >= min_bytes:
                    seen[ptr] = max(seen.get(ptr, 0), n)
    return sorted((p, p + n) for p, n in seen.items())


def huge_page_spans(ranges: list[tuple[int, int]], mappings: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The 2 MiB-aligned spans to collapse: weights sit in many storages of a few MB each, mostly side by side in
    one anonymous mapping (glibc maps each large allocation, the kernel merges neighbours), so ranges less than a
    huge page apart are joined, cut to the mapping they lie in, and trimmed to whole huge pages. A span may take in
    a little memory between two weights; never memory outside a mapping."""
    spans: list[tuple[int, int]] = []
    for m_lo, m_hi in mappings:
        inside = [(max(lo, m_lo), min(hi, m_hi)) for lo, hi in ranges if lo < m_hi and hi > m_lo]
        joined: list[list[int]] = []
        for lo, hi in inside:
            if joined and lo - joined[-1][1] < HUGE_PAGE:
                joined[-1][1] = max(joined[-1][1], hi)
            else:
                joined.append([lo, hi])
        for lo, hi in joined:
            a, b = (lo + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), hi & ~(HUGE_PAGE - 1)
            if b > a:
                spans.append((a, b))
    return spans


def anonymous_mappings() -> list[tuple[int, int]]:
    """This process's private writable anonymous mappings (where torch's CPU tensors live), from /proc/self/maps."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            path = parts[5] if len(parts) > 5 else ""
            if parts[1].startswith("rw") and parts[1].endswith("p") and path in ("", "[heap]"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


def collapse(spans: list[tuple[int, int]]) -> int:
    """``MADV_HUGEPAGE`` + ``MADV_COLLAPSE`` on each span; returns the bytes collapsed (0 where the kernel refuses:
    older than 6.1, THP ``never``, or no huge page free)."""
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for a, b in spans:
        madvise(a, b - a, MADV_HUGEPAGE)
        if madvise(a, b - a, MADV_COLLAPSE) == 0:
            done += b - a
    return done


def weights_to_huge_pages(*modules: nn.Module | None) -> int:
    """Collapse the weights of these modules (a model, its drafter) into huge pages; returns the bytes moved."""
    if not sys.platform.startswith("linux"):
        return 0
    t0 = time.perf_counter()
    ranges = weight_ranges([m for m in modules if m is not None])
    total = sum(hi - lo for lo, hi in ranges)
    if total < HUGE_PAGE:
        return 0
    done = collapse(huge_page_spans(ranges, anonymous_mappings()))
    logger.info("weights in huge pages: %.0f MiB for %.0f MiB of weights in %d storages, in %.2f s", done / 2**20,
                total / 2**20, len(ranges), time.perf_counter() - t0)
    return done
