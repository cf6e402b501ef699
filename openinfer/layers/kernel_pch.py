"""A precompiled header of the torch headers every kernel source includes, for a build on few cores.

Parsing ``torch/library.h`` and ``ATen/core/Tensor.h`` is most of each source's compile: 6.1 of moe_ops.cpp's 10.0 CPU
s at -O3, 23 sources. Compiled once (17.8 CPU s, one serial step), the header makes each source ~4 CPU s cheaper
(moe_ops.cpp 10.0 -> 5.8 CPU s). That pays when the sources outnumber the cores several times over (with 23 sources:
up to 5 cores, CI's 2 among them), not on a many-core host, where the serial step would be most of the build.

Only GCC: its PCH is skipped, with no error, whenever the flags differ from the build's (the sources then read the
headers as text), so a mismatch costs time, never correctness. The build always passes ``-include`` of the header
(the plain text file; the ``.gch`` beside it is what GCC picks up when it exists), so the compile command, which
ninja compares with its log, is the same whether or not the PCH was made, and a cached build is never recompiled
for it. The ``.gch`` (~280 MB) is removed after the build: only a compile reads it.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sysconfig
import time
from pathlib import Path

logger = logging.getLogger(__name__)

HEADER = "openinfer_torch_headers.h"
# the torch / c10 headers the kernel sources include (each source still includes what it uses)
_INCLUDES = ("ATen/Parallel.h", "ATen/core/Tensor.h", "c10/util/BFloat16.h", "c10/util/Half.h",
             "c10/util/Float8_e4m3fn.h", "torch/library.h")
SOURCES_PER_CORE = 4  # below this the serial PCH compile costs more wall time than it saves (17.8 vs ~4 s / source)


def include_flag(build_dir: str) -> list[str]:
    """The ``-include`` flag for the build (writes the header text once); the same on every load of this build."""
    path = Path(build_dir) / HEADER
    if any(c.isspace() for c in str(path)):  # torch writes the flags into build.ninja unquoted
        return []
    text = "".join(f"#include <{h}>\n" for h in _INCLUDES)
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return ["-include", str(path)]


def worth_it(n_sources: int) -> bool:
    """True when the build's sources outnumber the usable cores SOURCES_PER_CORE times or more."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return n_sources >= SOURCES_PER_CORE * cores


def precompile(build_dir: str, name: str, flags: list[str]) -> Path | None:
    """Compile the header into ``<header>.gch`` with the flags torch compiles the sources with; None (and the build
    goes on without it) when the compiler is not GCC or the compile fails."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if not cpp_extension.check_compiler_is_gcc(cxx):
        return None
    header = Path(build_dir) / HEADER
    gch = header.with_name(HEADER + ".gch")
    tmp = header.with_name(f"{HEADER}.{os.getpid()}.gch.tmp")
    includes = [*cpp_extension.include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
    # torch's compile command for a source (cpp_extension._write_ninja_file_to_build_library), minus -c / -o
    cmd = [cxx, f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
           *[a for inc in includes for a in ("-isystem", inc)], "-fPIC", "-std=c++20", *flags,
           "-x", "c++-header", str(header), "-o", str(tmp)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        logger.debug("no precompiled header (%s); the build reads the headers as text", r.stderr[-500:])
        tmp.unlink(missing_ok=True)
        return None
    os.replace(tmp, gch)
    logger.debug("precompiled the torch headers in %.1f s", time.perf_counter() - t0)
    return gch
