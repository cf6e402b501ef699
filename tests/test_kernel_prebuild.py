"""When xdist's controller starts the slow tests' extra kernel builds at idle priority (kernel_prebuild), and how a
test waits for its build. No build runs here: ``wanted`` on stand-in configs, ``wait`` on a hand-written builder
folder; the builds themselves run in every CI run, where test_avx2_variant.py and test_gguf_quant.py load them."""
import json
import os
import sys
from pathlib import Path

import kernel_prebuild
import pytest

HERE = Path(__file__).parent


class _Config:
    def __init__(self, args, markexpr="", numprocesses=2, worker=False):
        self.args = [str(a) for a in args]
        self._opts = {"markexpr": markexpr, "numprocesses": numprocesses}
        if worker:
            self.workerinput = {}

    def getoption(self, name, default=None):
        return self._opts.get(name, default)


@pytest.fixture
def avx512(monkeypatch):
    import platform

    import openinfer.platform as plat

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(plat, "cpu_info", lambda: ("cpu", {"avx2", "avx512f"}))
    monkeypatch.delenv("OPENINFER_KERNEL_CFLAGS", raising=False)
    monkeypatch.delenv("OPENINFER_CPU_KERNELS", raising=False)


def test_started_only_where_their_tests_run(avx512):
    both = ["gguf-x86-64", "avx2-variant"]
    assert kernel_prebuild.wanted(_Config([HERE], "not serial")) == both  # CI's parallel pass
    assert kernel_prebuild.wanted(_Config([HERE])) == both
    assert kernel_prebuild.wanted(_Config([HERE / "test_avx2_variant.py::test_kernel_tests_pass_on_the_avx2_build"])) \
        == ["avx2-variant"]
    assert kernel_prebuild.wanted(_Config([HERE / "test_gguf_quant.py"])) == ["gguf-x86-64"]
    assert kernel_prebuild.wanted(_Config([HERE], "serial")) == []  # CI's serial pass
    assert kernel_prebuild.wanted(_Config([HERE], "not slow")) == []  # the developer loop
    assert kernel_prebuild.wanted(_Config([HERE / "test_gemv.py"])) == []
    assert kernel_prebuild.wanted(_Config([HERE], numprocesses=0)) == []  # no xdist: each test builds its own
    assert kernel_prebuild.wanted(_Config([HERE], worker=True)) == []


def test_not_on_hosts_or_runs_without_them(avx512, monkeypatch):
    import openinfer.platform as plat

    monkeypatch.setenv("OPENINFER_KERNEL_CFLAGS", "-march=x86-64-v3")  # already the variant's run
    assert kernel_prebuild.wanted(_Config([HERE])) == []
    monkeypatch.delenv("OPENINFER_KERNEL_CFLAGS")
    monkeypatch.setattr(plat, "cpu_info", lambda: ("cpu", {"avx2"}))  # the native build is the AVX2 build
    assert kernel_prebuild.wanted(_Config([HERE])) == ["gguf-x86-64"]


def test_wait_reads_the_outcome_or_notices_a_dead_builder(tmp_path, monkeypatch):
    monkeypatch.delenv(kernel_prebuild.ENV_DIR, raising=False)
    assert kernel_prebuild.wait("gguf-x86-64", 1) is None  # nothing started
    monkeypatch.setenv(kernel_prebuild.ENV_DIR, str(tmp_path))
    assert kernel_prebuild.wait("gguf-x86-64", 1) is None  # started, but not this build
    (tmp_path / "gguf-x86-64.py").write_text("")
    (tmp_path / "pid").write_text(str(os.getpid()))  # alive, never finishing
    (tmp_path / "log").write_text("compiling")
    with pytest.raises(TimeoutError, match="compiling"):
        kernel_prebuild.wait("gguf-x86-64", 0.5)
    import subprocess

    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "pid").write_text(p.stdout.strip())  # exited without writing its result
    assert kernel_prebuild.wait("gguf-x86-64", 5) == {"ok": False, "error": "the builder exited without a result"}
    (tmp_path / "gguf-x86-64.done").write_text(json.dumps({"ok": True}))
    assert kernel_prebuild.wait("gguf-x86-64", 5) == {"ok": True}


def test_the_builder_runs_each_build_in_a_process_of_its_own(avx512, monkeypatch):
    """Two builds registering the same op name (as every kernel build registers openinfer_cpu's): in one process the
    second would abort it."""
    code = ("import torch\ntorch.library.define('prebuild_test::op', '(Tensor x) -> Tensor')\n"
            "open({d!r} + '.ran', 'w').close()\n")
    me = HERE / "test_kernel_prebuild.py"
    monkeypatch.setattr(kernel_prebuild, "BUILDS", {"one": (me, lambda f: True, code), "two": (me, lambda f: True, code)})
    monkeypatch.setenv(kernel_prebuild.ENV_DIR, "")  # restored after the test; start() sets it
    kernel_prebuild.start(_Config([me]))
    try:
        assert kernel_prebuild.wait("one", 120) == {"ok": True, "error": ""}
        assert kernel_prebuild.wait("two", 120) == {"ok": True, "error": ""}
        top = os.environ[kernel_prebuild.ENV_DIR]
        assert os.path.exists(os.path.join(top, "one.ran")) and os.path.exists(os.path.join(top, "two.ran"))
    finally:
        kernel_prebuild.stop()
