"""platform.py (malloc): glibc's mallopt knobs set once per process, and the switch that leaves them alone."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_PROBE = ("import openinfer.platform as m; a = m.tune_malloc(); b = m.tune_malloc(); "
          "print(a, b)")


def _probe(env_value: str | None) -> str:
    import os

    env = dict(os.environ)
    env.pop("OPENINFER_MALLOC_TUNING", None)
    if env_value is not None:
        env["OPENINFER_MALLOC_TUNING"] = env_value
    # a fresh process: the settings are process-wide and applied once
    return subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout.split()


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_malloc_tuning_applies_on_glibc_once():
    assert _probe(None) == ["True", "True"]


def test_malloc_tuning_can_be_turned_off():
    assert _probe("0") == ["False", "False"]
