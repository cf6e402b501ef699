"""The extra kernel builds some slow tests check (the x86-64-v3 variant of the whole extension for
``test_avx2_variant.py``, the GGUF sources for plain x86-64 for ``test_gguf_quant.py``), started by xdist's
controller at the run's start and compiled at ``SCHED_IDLE``: on the cycles the tests leave idle (workers waiting
on servers, ranks, sockets) instead of holding a worker for the minutes of the builds.

Each test waits for its build (``wait``) and then loads it from the cache: the same name, sources and flags in
the same folder, so ninja finds nothing to do. A build starts only where its test will run in this pytest run
(xdist on, the host the test needs, its file among the paths, the marker expression keeping ``slow`` tests). One
builder process runs them in turn, each in a process of its own (every build registers the same op names).
``SCHED_IDLE`` (not ``nice``) because ninja and the compilers inherit it, and the builder stays in pytest's session
(a new session gets its own autogroup, which the scheduler would share the cores with as an equal).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
ENV_DIR = "OPENINFER_TEST_PREBUILD_DIR"  # the builder's folder (log, pid, a result file per build); workers inherit it
VARIANT_CFLAGS = "-march=x86-64-v3"
GGUF_SOURCES = ("gguf_gemm.cpp", "gguf_q8_gemm.cpp", "gguf_q8_tiles.cpp", "gguf_repack.cpp")


def gguf_load_args(march: str, build_dir: str) -> dict:
    """``cpp_extension.load``'s arguments for the GGUF sources alone built for ``march`` (test_gguf_quant.py's
    variant check and the prebuild use the same, so the test's load finds the build done)."""
    kdir = HERE.parent / "openinfer" / "layers" / "cpu_kernels"
    return dict(name="gguf_variant_" + march.replace("-", "_"), sources=[str(kdir / f) for f in GGUF_SOURCES],
                extra_cflags=["-O3", "-march=" + march, "-fopenmp"], extra_ldflags=["-fopenmp"],
                build_directory=build_dir, is_python_module=False)


# name -> (the test file that uses it, the host check, the builder's code for it; {d} is the build's folder)
BUILDS = {
    "gguf-x86-64": (HERE / "test_gguf_quant.py", lambda flags: True, """
import os, sys
sys.path.insert(0, {here!r})
from torch.utils import cpp_extension
from kernel_prebuild import gguf_load_args
os.makedirs({d!r}, exist_ok=True)
cpp_extension.load(**gguf_load_args("x86-64", {d!r}))
"""),
    "avx2-variant": (HERE / "test_avx2_variant.py", lambda flags: "avx512f" in flags, """
import os
os.environ["OPENINFER_KERNEL_CFLAGS"] = {cflags!r}
from openinfer.layers import dispatch
sel = dispatch.active()
assert sel.kernels, sel.build
"""),
}

_BUILDER = """
import json, os, subprocess, sys
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # inherited by each build's process, ninja, compilers
top = sys.argv[1]
for name in sys.argv[2:]:  # a process each: every build registers the same op names
    r = subprocess.run([sys.executable, os.path.join(top, name + ".py")], capture_output=True, text=True)
    out = {{"ok": r.returncode == 0, "error": (r.stdout + r.stderr)[-1500:] if r.returncode else ""}}
    with open(os.path.join(top, name + ".tmp"), "w") as f:
        json.dump(out, f)
    os.replace(os.path.join(top, name + ".tmp"), os.path.join(top, name + ".done"))
"""

_proc: subprocess.Popen | None = None


def wanted(config) -> list[str]:
    """The builds this run (xdist's controller) will use."""
    import platform

    from _pytest.mark.expression import Expression

    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return []
    if os.environ.get("OPENINFER_KERNEL_CFLAGS") or os.environ.get("OPENINFER_CPU_KERNELS") == "0":
        return []
    if platform.machine() not in ("x86_64", "AMD64") or not hasattr(os, "SCHED_IDLE"):
        return []
    markexpr = config.getoption("markexpr", "")
    markers = {"slow", "timeout", "skipif", "parametrize"}  # what those tests carry
    if markexpr and not Expression.compile(markexpr).evaluate(lambda m, **kw: m in markers):
        return []
    from openinfer.platform import cpu_info

    flags = cpu_info()[1]
    paths = [Path(str(a).split("::")[0]).resolve() for a in config.args] or [Path.cwd()]
    return [name for name, (test, host_ok, _) in BUILDS.items()
            if host_ok(flags) and any(p == test or p in test.parents for p in paths)]


def start(config) -> None:
    """Start the builder (one low-priority process in this session) for the ``wanted`` builds."""
    global _proc
    names = wanted(config)
    if not names:
        return
    top = tempfile.mkdtemp(prefix="openinfer-prebuild-")
    os.environ[ENV_DIR] = top
    for name in names:
        Path(top, name + ".py").write_text(BUILDS[name][2].format(here=str(HERE), d=build_dir(name, top),
                                                                  cflags=VARIANT_CFLAGS))
    with open(os.path.join(top, "log"), "w") as log:
        _proc = subprocess.Popen([sys.executable, "-c", _BUILDER.format(), top, *names], stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0)
    Path(top, "pid").write_text(str(_proc.pid))


def build_dir(name: str, top: str | None = None) -> str | None:
    """The folder a build goes to (None where no prebuild runs); the variant's is torch's extension cache."""
    top = top or os.environ.get(ENV_DIR)
    return os.path.join(top, name) if top and name != "avx2-variant" else None


def stop() -> None:
    """End a builder still running when the run ends (its whole process group: ninja and the compilers)."""
    if _proc is not None and _proc.poll() is None:
        import signal

        try:
            os.killpg(_proc.pid, signal.SIGTERM)
            _proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


def wait(name: str, timeout_s: float) -> dict | None:
    """In a test: its build's outcome once the builder has it (None when no prebuild of it runs), so the test's
    subprocesses load it instead of waiting on torch's build lock, whose stale-lock bound an idle-priority build
    may outlive. Raises TimeoutError past ``timeout_s``."""
    top = os.environ.get(ENV_DIR)
    if not top or not Path(top, name + ".py").exists():
        return None
    done = Path(top, name + ".done")
    t_end = time.monotonic() + timeout_s
    while not done.exists():
        if not _alive(int(Path(top, "pid").read_text())):
            time.sleep(1.0)  # it may have written the file just before exiting
            if not done.exists():
                return {"ok": False, "error": "the builder exited without a result"}
            break
        if time.monotonic() > t_end:
            log = Path(top, "log").read_text(errors="replace")[-2000:]
            raise TimeoutError(f"the prebuild {name} did not finish in {timeout_s:.0f} s; its log: {log}")
        time.sleep(1.0)
    return json.loads(done.read_text())


def _alive(pid: int) -> bool:
    """The process exists and has not exited (an exited child the controller has not reaped is a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
