"""Building the C++ CPU kernels (``cpu_kernels/``) with ``torch.utils.cpp_extension``, once per process and flags.

The sources are compiled for the machine that runs them (``-march=native``) into torch's extension cache
(``TORCH_EXTENSIONS_DIR`` or its default) or ``KernelConfig.cache_dir``; later processes load the cached build. A
failed build raises ``KernelBuildError`` with the compiler's first error line: ``layers/dispatch.py`` decides what
that means (start-up stops unless the torch backend was asked for), never this module.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from openinfer.layers import kernel_pch

logger = logging.getLogger(__name__)

# Every .cpp in cpu_kernels/ goes into the one extension (one build, one cache entry, one op namespace).
KERNEL_DIR = Path(__file__).parent / "cpu_kernels"
_SOURCES = sorted(KERNEL_DIR.glob("*.cpp"))
BASE_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast"]
_LDFLAGS = ("-fopenmp",)  # a tuple: cpp_extension.load appends torch's libraries to the list it is given


class KernelBuildError(RuntimeError):
    """The CPU kernels did not build or load; the message names the compiler's first error."""


@dataclass(frozen=True)
class BuildResult:
    ops: object  # the torch.ops.openinfer_cpu namespace
    name: str  # the extension's name (its cache folder)
    how: str  # "built" (compiled now) or "cached" (loaded from the cache)
    seconds: float
    cflags: tuple[str, ...]


_lock = threading.Lock()
_results: dict[tuple[str, str | None], BuildResult | KernelBuildError] = {}  # (cflags, cache dir) -> outcome


def ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the ``ninja`` wheel installs it next to the interpreter, which is not
    on PATH when the venv's python is run without activating the venv."""
    if shutil.which("ninja"):
        return
    candidates = [os.path.dirname(sys.executable)]
    with contextlib.suppress(ImportError, AttributeError):  # the wheel is optional
        import ninja  # type: ignore[import-not-found]

        candidates.insert(0, ninja.BIN_DIR)
    for d in candidates:
        if os.path.isfile(os.path.join(d, "ninja")):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return


def toolchain() -> str | None:
    """None when a C++ compiler and ninja are found, else what is missing (the kernels cannot be built here)."""
    ninja_on_path()
    missing = [what for what, found in (("a C++ compiler (c++ / g++)", shutil.which("c++") or shutil.which("g++")),
                                        ("ninja", shutil.which("ninja"))) if not found]
    return " and ".join(missing) or None


def cflags(extra: str = "") -> list[str]:
    """The build's flags: ``extra`` (KernelConfig.cflags) is appended, so later flags win: e.g.
    ``-march=x86-64-v3`` builds the AVX2 code on an AVX-512 host, which is how the tests cover AVX2 machines."""
    return BASE_CFLAGS + extra.split()


def extension_name(flags: list[str], kernel_dir: Path = KERNEL_DIR) -> str:
    """The extension's name, which is its build directory's name in the cache. It carries a hash of sources,
    flags, torch and the CPU: an edited kernel, another torch, or a cache directory shared with a different CPU
    (-march=native) builds afresh instead of loading a stale or illegal-instruction library. It carries the
    sources' directory too: torch's build.ninja names the sources by path, so two checkouts of the same code
    sharing one cache directory (a worktree and the main checkout, a script importing the installed copy) would
    otherwise rewrite it in turn and each rebuild everything (minutes) on the other's next load."""
    from openinfer.platform import cpu_info

    h = hashlib.sha256()
    for src in sorted(kernel_dir.glob("*.[ch]*")):  # the headers too: an edited vec.h must rebuild
        h.update(src.read_bytes())
    h.update(" ".join([*flags, *_LDFLAGS]).encode())
    h.update(torch.__version__.encode())
    h.update(str(kernel_dir.resolve()).encode())
    model, cpu_flags = cpu_info()
    h.update((model + " " + " ".join(sorted(cpu_flags))).encode())
    return f"openinfer_cpu_{h.hexdigest()[:12]}"


def build(extra_cflags: str = "", cache_dir: str | None = None) -> BuildResult:
    """The kernels for these flags, built or loaded once per process; raises ``KernelBuildError`` (the same one
    on every later call) when they cannot be."""
    key = (extra_cflags, cache_dir)
    with _lock:
        if key not in _results:
            try:
                _results[key] = _build(extra_cflags, cache_dir)
            except Exception as e:  # noqa: BLE001 - any build / load failure becomes one error naming its cause
                _results[key] = KernelBuildError(f"the CPU kernel build failed ({first_error(e)})")
        result = _results[key]
    if isinstance(result, KernelBuildError):
        raise result
    return result


def _build(extra_cflags: str, cache_dir: str | None) -> BuildResult:
    from torch.utils import cpp_extension

    missing = toolchain()
    if missing:
        raise RuntimeError(f"no {missing} found")
    flags = cflags(extra_cflags)
    name = extension_name(flags)
    build_dir = None
    if cache_dir:
        build_dir = os.path.join(cache_dir, name)
        os.makedirs(build_dir, exist_ok=True)
    resolved_dir = build_dir or cpp_extension._get_build_directory(name, verbose=False)
    cached = any(Path(resolved_dir).glob(f"{name}*.so"))
    clear_stale_lock(resolved_dir)
    t0 = time.perf_counter()
    os.makedirs(resolved_dir, exist_ok=True)
    include = kernel_pch.include_flag(resolved_dir)  # the same on every load, so ninja never recompiles for it
    pch = None
    if include and not cached and kernel_pch.worth_it(len(_SOURCES)):
        pch = kernel_pch.precompile(resolved_dir, name, flags)
    try:
        cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES], extra_cflags=flags + include,
                           extra_ldflags=list(_LDFLAGS), build_directory=build_dir, is_python_module=False,
                           verbose=False)
    finally:
        if pch is not None:
            pch.unlink(missing_ok=True)
    took = time.perf_counter() - t0
    how = "cached" if cached and took < 5.0 else "built"
    # a fresh build (minutes on 2 cores) delays start-up: say so; a cached load is quiet
    logger.log(logging.INFO if how == "built" else logging.DEBUG, "openinfer CPU kernels %s in %.1f s (%s)", how,
               took, name)
    return BuildResult(ops=torch.ops.openinfer_cpu, name=name, how=how, seconds=took, cflags=tuple(flags))


def clear_stale_lock(build_dir: str) -> None:
    """torch's build lock is a file that a killed build leaves behind, and every later load then waits on it
    forever (a hang in nanosleep at engine start). A build takes seconds to a few minutes, so a lock older than
    ``OPENINFER_KERNEL_LOCK_STALE_S`` (default 600) belongs to no live build: it is removed, with a warning. When
    the lock is younger, another process may be building: a watcher thread removes it if it outlives the bound
    while this process waits on it (never this process's own lock: it only watches a lock that existed before)."""
    from openinfer import envs

    lock = os.path.join(build_dir, "lock")
    stale_s = envs.KERNEL_LOCK_STALE_S

    def remove_if_stale() -> bool:
        try:
            age = time.time() - os.path.getmtime(lock)
        except OSError:
            return True  # gone: the other build finished
        if age <= stale_s:
            return False
        logger.warning("removing a stale kernel build lock %s (%.0f s old: a build that was killed); "
                       "%s sets the age", lock, age, envs.variable("KERNEL_LOCK_STALE_S"))
        with contextlib.suppress(FileNotFoundError):
            os.remove(lock)
        return True

    if not os.path.exists(lock) or remove_if_stale():
        return
    logger.info("waiting for another process's kernel build (lock %s; removed as stale after %.0f s)", lock, stale_s)

    def watch() -> None:
        while not remove_if_stale():
            time.sleep(1.0)

    threading.Thread(target=watch, name="kernel-lock-watch", daemon=True).start()


def first_error(e: Exception) -> str:
    """One line: the compiler's first error when there is one, else the exception's last line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    found = next((ln for ln in lines if "error:" in ln), None)
    return f"{type(e).__name__}: {found or (lines[-1] if lines else '')}"[:500]
