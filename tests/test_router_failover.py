"""Through the real vllm-router (``openinfer router --worker-urls``): a client that hangs up mid-stream aborts the
request on the worker, and requests sent to a worker that died before answering are retried on the other one
(vllm-router's own retries: ``--retry-max-retries``, on by default; ``--disable-retries`` turns them off)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_utils import REPO, ServerProcess, free_port, shared_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # a deployment of worker processes and the router

ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "128", "--served-model-name", "tiny"]
BODY = {"model": "tiny", "prompt": "route me", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    ckpt = shared_checkpoint(tmp_path_factory)
    a = ServerProcess(ckpt, *ARGS, wait=False)
    b = ServerProcess(ckpt, *ARGS, wait=False)
    launcher = None
    try:
        a.wait_ready()
        b.wait_ready()
        cmd = [sys.executable, "-m", "openinfer", "router", "--worker-urls", a.url, b.url, "--policy", "round_robin",
               "--port", str(free_port())]
        launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        info = json.loads(launcher.stdout.readline())
        yield info, a, b
    finally:
        if launcher is not None:
            launcher.send_signal(signal.SIGTERM)
            assert launcher.wait(30) == 0
        a.stop()
        b.stop()


def running_and_aborted(server) -> tuple[float, float]:
    m = server.metrics()
    return m["openinfer:num_requests_running"], m['openinfer:request_success_total{finished_reason="abort"}']


def test_client_disconnect_reaches_the_worker(deployment):
    info, a, b = deployment
    before = [running_and_aborted(s)[1] for s in (a, b)]
    body = {**BODY, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", info["router"] + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held open: leaving a for loop over it would close the response already
        assert next(line for line in lines if line.startswith("data: {"))
        assert sum(running_and_aborted(s)[0] for s in (a, b)) == 1  # still generating while we listen
    # the client hangs up with the first token out
    deadline = time.monotonic() + 10
    while True:
        now = [running_and_aborted(s) for s in (a, b)]
        if sum(r for r, _ in now) == 0:
            break
        assert time.monotonic() < deadline, "the worker kept generating for a client that left"
        time.sleep(0.05)
    assert sum(ab for _, ab in now) - sum(before) == 1  # ended as aborted, not as a 1000-token finish


def test_requests_to_a_dead_worker_are_retried_elsewhere(deployment):
    info, a, b = deployment

    def retries() -> float:
        text = httpx.get(info["router_metrics"], timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm_router_retries_total"))

    ok_before = a.metrics()['openinfer:request_success_total{finished_reason="length"}']
    retries_before = retries()
    b.proc.kill()  # dies without answering; the router still lists it as healthy (no health check yet)
    b.proc.wait()
    for i in range(6):  # round robin sends every other one to b
        stream = i % 2 == 1
        r = httpx.post(info["router"] + "/v1/completions", json={**BODY, "stream": stream}, timeout=60)
        assert r.status_code == 200, r.text
        assert ("data: [DONE]" in r.text) if stream else r.json()["choices"][0]["finish_reason"] == "length"
    assert a.metrics()['openinfer:request_success_total{finished_reason="length"}'] - ok_before == 6
    assert retries() - retries_before >= 1  # the router retried (not just skipped b as unhealthy)
