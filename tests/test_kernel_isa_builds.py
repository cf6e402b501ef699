"""The CPU kernels' AVX-512 / AMX code compiles, on a host that cannot run it.

The kernels are built with -march=native, so on the AVX2 machines CI and most sessions run on, the code under
``#if __AVX512F__`` / ``__AMX_TILE__`` (the AMX decode-attention and MLA tiles, the AVX-512 gemv, VNNI in the W8A8
kernel) is never compiled. It broke once that way: a helper the AMX MLA tile loop called was removed from
mla_decode.cpp, every AMX host's kernel build then failed, and the engine fell back to its torch path there
(then with a warning; a failed build now stops start-up, layers/dispatch.py). This compiles the sources that carry such code for Sapphire Rapids
(AVX-512 + AVX512-BF16 + AMX) with ``-fsyntax-only``: parsing and template instantiation, no code generation
(~15 s on 2 cores; all sources would take ~1 minute, see _isa_sources). Sources whose every such macro the native
build defines were compiled by it (on an AVX-512 host with VNNI and BF16 only the AMX ones are left; 42 s of a CI
worker -> ~12 s), so they are not parsed twice. It cannot show the AMX code is right; the kernel tests do that where
the CPU has AMX.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.utils import cpp_extension

from openinfer.layers import kernel_build
from openinfer.platform import cpu_info

pytestmark = pytest.mark.slow  # parses kernel sources with the torch headers (seconds each)

CXX = os.environ.get("CXX", "g++")
ISA_MACRO = re.compile(r"__(?:AVX512|AMX)\w*__")
LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"', re.M)


def _macros(path, seen) -> set[str]:
    """The AVX-512 / AMX macros a source tests, in its own text and its local headers (followed transitively).
    vec.h is not followed: its AVX-512 branch only sets the vector width that every kernel's generic code is
    written against (kW), and parsing every source for it (~25 x 4 s of torch headers) is what this test leaves
    out."""
    if path.name == "vec.h" or path in seen or not path.exists():
        return set()
    seen.add(path)
    text = path.read_text()
    found = set(ISA_MACRO.findall(text))
    for inc in LOCAL_INCLUDE.findall(text):
        found |= _macros(path.parent / inc, seen)
    return found


def _isa_sources() -> list:
    """Kernel sources whose own text or local headers test an AVX-512 / AMX macro."""
    return [src for src in kernel_build._SOURCES if _macros(src, set())]


def _native_macros() -> set[str]:
    """The ISA macros -march=native defines: the code under them was compiled by the native kernel build."""
    r = subprocess.run([CXX, "-march=native", "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True,
                       text=True, timeout=60, check=True)
    return set(ISA_MACRO.findall(r.stdout))


def _flags(march: str) -> list[str]:
    # what torch's cpp_extension passes (its build.ninja's cflags), with the ISA swapped and no code generation
    inc = [*cpp_extension.include_paths(), sysconfig.get_path("include")]
    return ["-std=c++20", "-fsyntax-only", "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=isa_check",
            *(f"-isystem{p}" for p in inc), "-fopenmp", f"-march={march}"]


@pytest.mark.skipif(shutil.which(CXX) is None, reason="no C++ compiler: the kernels cannot build here either")
def test_kernels_compile_for_avx512_and_amx(kernel_ops):
    flags = _flags("sapphirerapids")

    def check(src):
        r = subprocess.run([CXX, *flags, str(src)], capture_output=True, text=True, timeout=600)
        return src.name, r.returncode, r.stderr

    sources = _isa_sources()
    # the ones known to carry such code: the AMX attention / MLA tiles, the AVX-512 gemv, VNNI W8A8
    assert {"paged_decode_attention.cpp", "mla_decode.cpp", "gemv.cpp", "w8a8_gemm.cpp"} <= {s.name for s in sources}
    native = _native_macros()  # kernel_ops: the native build of every source succeeded
    sources = [src for src in sources if not _macros(src, set()) <= native]
    # the AMX tiles (attention, MLA) are under __AMX_*__, which no CPU without AMX defines
    assert "amx_bf16" in cpu_info()[1] or {"paged_decode_attention.cpp", "mla_decode.cpp"} <= {s.name for s in sources}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(check, sources))
    failed = {name: err[-2000:] for name, rc, err in results if rc != 0}
    assert not failed, f"kernel sources that do not compile for -march=sapphirerapids: {failed}"
