import os
import sys
from pathlib import Path

# Tests share 2 cores; one intra-op thread per process avoids oversubscription stalls.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))
