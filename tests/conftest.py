import os
import sys
from pathlib import Path

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
