"""scripts/soak_server.py for ~5 s against a real ``openinfer serve``: agentic load with client cancellations
and poison requests mixed in; the report must say nothing was lost, no KV block leaked, every poison request
got a 4xx, and the server is healthy afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from server_utils import REPO, ServerProcess, shared_checkpoint

ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "256", "--served-model-name", "tiny",
        "--max-num-seqs", "8", "--max-body-bytes", "1048576"]


@pytest.mark.slow
@pytest.mark.serial  # a timed 5 s soak (load, cancels, poison requests) on a server process: no neighbours
def test_soak_reports_nothing_lost_or_leaked(tmp_path_factory, tmp_path):
    ckpt = shared_checkpoint(tmp_path_factory)
    out = tmp_path / "soak.json"
    with ServerProcess(ckpt, *ARGS) as s:
        cmd = [sys.executable, "scripts/soak_server.py", "--url", s.url, "--tokenizer", str(ckpt),
               "--duration", "5", "--concurrency", "8", "--sessions", "16", "--cancel-prob", "0.3",
               "--cancel-max-s", "0.5", "--poison-rate", "3", "--max-body-bytes", "1048576",
               "--sample-interval", "0.5", "--stall-timeout", "30", "--out", str(out)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr + s.log()
        assert s.alive
    report = json.loads(out.read_text())
    r = report["requests"]
    assert r["lost"] == 0 and r["errored"] == 0, report["first_error_by_category"]
    assert r["finished"] > 0 and r["cancelled"] > 0
    assert r["sent"] == r["finished"] + r["errored"] + r["cancelled"] + r["lost"]
    assert report["kv_blocks"] == {"total": 256, "leaked": 0, "server_idle_at_end": True}
    assert report["poison"]["sent"] > 0 and report["poison"]["not_4xx"] == {}, report["poison"]
    assert report["health_after"] == {"/health": 200, "/health/ready": 200}
    assert len(report["samples"]) >= 5 and all(x["rss_bytes"] > 0 for x in report["samples"])
    assert report["ok"] is True
