import os
import sys
from pathlib import Path

import pytest

# Tests share 2 cores; one intra-op thread per process avoids oversubscription stalls.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    # openinfer's logger prints through its own handler and stops propagation (so library users see its INFO
    # lines once); configure it once up front and let records propagate again, so ``caplog`` sees them
    # whichever test happens to create the first engine.
    import logging

    from openinfer.logging_utils import init_logging

    init_logging()
    logging.getLogger("openinfer").propagate = True


def _toolchain() -> bool:
    import shutil

    from openinfer.layers import cpu_ops

    cpu_ops._ninja_on_path()
    return bool(shutil.which("c++") or shutil.which("g++")) and bool(shutil.which("ninja"))


@pytest.fixture
def kernel_ops():
    """The built kernel. With a C++ compiler and ninja present, a failed build fails the test (no skip)."""
    from openinfer.layers import cpu_ops

    if not cpu_ops.enabled():
        pytest.skip("OPENINFER_CPU_KERNELS=0")
    if not _toolchain():
        pytest.skip("no C++ compiler or ninja: the CPU kernels cannot be built here")
    ops = cpu_ops.get_ops()
    assert ops is not None, f"CPU kernel build failed: {cpu_ops._state.get('error')}"
    return ops
