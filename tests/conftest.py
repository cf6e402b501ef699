import os
import sys
from pathlib import Path

import pytest

# Tests share 2 cores; one intra-op thread per process avoids oversubscription stalls.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray reads this once, when first imported: 0 keeps a local Ray node (and the actors it starts) on loopback. Set
# before any test module can import ray; tests/test_ray_executor.py relies on it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    # openinfer's logger prints through its own handler and stops propagation (so library users see its INFO
    # lines once); configure it once up front and let records propagate again, so ``caplog`` sees them
    # whichever test happens to create the first engine.
    import logging

    from openinfer.logging_utils import init_logging

    init_logging()
    logging.getLogger("openinfer").propagate = True
    if not hasattr(config, "workerinput"):  # the main process (xdist's controller, or a plain run)
        import kernel_prebuild

        kernel_prebuild.start(config)  # the slow tests' extra kernel builds, at idle priority, beside the tests
        _build_kernels_once()


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        import kernel_prebuild

        kernel_prebuild.stop()


def pytest_ignore_collect(collection_path, config):
    """CI's serial pass (``-m serial``) imports only the test files that mark a test serial: collecting all of them
    (~2,000 tests, every module imported) took 10 of its ~90 s to deselect all but ~40."""
    if (config.getoption("markexpr") == "serial" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")):
        return "mark.serial" not in collection_path.read_text(errors="ignore") or None
    return None


def _build_kernels_once() -> None:
    """Build the C++ kernels (or load the cached build) before any test starts. Otherwise the first test to need
    them builds them (minutes on a busy 2-core host), often in a subprocess that a test's timeout may kill mid-build;
    torch's build lock left behind then holds every later process for OPENINFER_KERNEL_LOCK_STALE_S. A failed build
    is not raised here: each test that needs the kernels fails with the build's error (``kernel_ops``)."""
    from openinfer.layers import dispatch

    try:
        dispatch.active()
    except Exception:  # noqa: BLE001 (reported by the tests that need the kernels)
        pass


@pytest.fixture
def kernel_ops():
    """The built kernel namespace. A failed build or a missing toolchain fails the test (no skip); only the explicit
    opt-out (OPENINFER_CPU_KERNELS=0, the torch backend) skips."""
    from helpers import require_kernels

    return require_kernels()


@pytest.fixture
def avx2_variant():
    """For the tests that rebuild the kernels for x86-64-v3 (AVX2, no AVX-512) to cover the AVX2 code on an AVX-512
    host. Without AVX-512 the native build already is that build (the kernels' only ISA switch is __AVX512F__, and
    AMX needs AVX-512), and the plain kernel tests ran it: skipped there, which saves CI a third kernel build."""
    import platform

    from openinfer.platform import cpu_info

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    if "avx512f" not in cpu_info()[1]:
        pytest.skip("no AVX-512 here: the native kernel build is the AVX2 build, already tested")


def pytest_collection_modifyitems(config, items):
    """On an xdist worker (CI's parallel pass: --dist loadfile --no-loadscope-reorder), hand out first the files that
    hold a test marked slow: they are the long ones (worker processes, deployments, subprocess builds), and one
    started last leaves the other worker idle at the end. xdist's own reorder (most tests first) put the one-test
    files (Ray, the ISA compile check) last. The order is the same on every worker, as xdist requires; a plain run
    keeps the file order."""
    if not hasattr(config, "workerinput"):
        return
    heavy = {item.path for item in items if item.get_closest_marker("slow")}
    # the x86-64-v3 reruns last of the heavy files: their build (kernel_prebuild) runs at idle priority meanwhile
    variant = Path(__file__).parent / "test_avx2_variant.py"
    items.sort(key=lambda item: (item.path not in heavy, item.path == variant))  # stable within each group
