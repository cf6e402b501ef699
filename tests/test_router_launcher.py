"""``openinfer router``: the real vllm-router in front of two real ``openinfer serve`` workers it started.
Answers through the router are the worker's own, round robin reaches both workers, SIGTERM to the launcher stops
every process, and a dead worker takes the deployment down with exit code 1 (no orphans either way)."""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_utils import REPO, free_port, shared_checkpoint

from openinfer.entrypoints.router_cli import check_args, router_command

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # deployments of worker processes and the router

WORKER_ARGS = "--dtype float32 --max-model-len 512 --num-kv-blocks 128 --served-model-name tiny"


def launch(ckpt, *extra: str) -> tuple[subprocess.Popen, dict]:
    port = free_port()
    cmd = [sys.executable, "-m", "openinfer", "router", "--start-workers", "2", "--model", str(ckpt),
           "--worker-args", WORKER_ARGS, "--port", str(port), "--stop-timeout-s", "10", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if sel.select(timeout=1.0):
            line = proc.stdout.readline()
            if line.startswith("{"):
                return proc, json.loads(line)
        if proc.poll() is not None:
            raise RuntimeError(f"launcher exited with {proc.returncode} before it was ready")
    proc.kill()
    raise TimeoutError("launcher not ready in 90s")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); it is gone once it is not running.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1].startswith("Z")


def wait_gone(pids: list[int], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(gone(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if not gone(p)]}"
        time.sleep(0.1)


def completion(url: str, prompt: str, **kw) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(url: str, prompt: str) -> tuple[str, str | None]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    text, finish = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
    return "".join(text), finish


def successes(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "openinfer:request_success_total")


def test_router_command_flags():
    ns = argparse.Namespace(router="vllm", host="127.0.0.1", port=9, policy="round_robin", prefill=[], decode=[],
                            router_args="--request-timeout-secs 5", model="m", start_workers=0, worker_urls=["u"],
                            kv_events=False)
    cmd = router_command(ns, ["http://a:1", "http://b:2"], 7)
    assert cmd[0].endswith("vllm-router")
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--worker-urls") + 3] == ["http://a:1", "http://b:2"]
    assert cmd[cmd.index("--policy") + 1] == "round_robin" and cmd[-2:] == ["--request-timeout-secs", "5"]
    assert cmd[cmd.index("--prometheus-port") + 1] == "7"
    kv = router_command(argparse.Namespace(**{**vars(ns), "policy": "kv_aware"}), ["http://a:1"], 7,
                        {"http://a:1": "tcp://a:5557"}, 32)
    assert kv[kv.index("--kv-event-source") + 1] == "http://a:1=tcp://a:5557"
    assert kv[kv.index("--kv-event-block-size") + 1] == "32" and kv[kv.index("--kv-event-model") + 1] == "m"
    with pytest.raises(ValueError, match="--kv-events needs"):
        check_args(argparse.Namespace(**{**vars(ns), "kv_events": True}))
    pd = argparse.Namespace(**{**vars(ns), "router": "sglang", "worker_urls": [], "router_args": "",
                               "prefill": [["http://p:1", "9000"]], "decode": ["http://d:2"]})
    check_args(pd)
    cmd = router_command(pd, [], 7)
    assert cmd[1] == "launch" and "--pd-disaggregation" in cmd and "--worker-urls" not in cmd
    assert cmd[cmd.index("--prefill"):cmd.index("--prefill") + 3] == ["--prefill", "http://p:1", "9000"]
    assert cmd[cmd.index("--decode") + 1] == "http://d:2"
    with pytest.raises(ValueError, match="both --prefill and --decode"):
        check_args(argparse.Namespace(**{**vars(pd), "decode": []}))
    with pytest.raises(ValueError, match="needs --model"):
        check_args(argparse.Namespace(**{**vars(ns), "start_workers": 2, "model": None}))
    with pytest.raises(ValueError, match="no workers"):
        check_args(argparse.Namespace(**{**vars(ns), "worker_urls": []}))


def test_round_robin_through_vllm_router(tmp_path_factory):
    ckpt = shared_checkpoint(tmp_path_factory)
    proc, info = launch(ckpt, "--policy", "round_robin")
    pids = [info["router_pid"], *info["worker_pids"]]
    try:
        router, (w0, w1) = info["router"], info["workers"]
        prompt = "the router forwards this prompt"
        direct, via = completion(w0, prompt), completion(router, prompt)
        assert via["choices"][0]["text"] == direct["choices"][0]["text"]
        assert via["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
        assert via["usage"]["completion_tokens"] == 8
        assert streamed(router, prompt) == streamed(w1, prompt) == (direct["choices"][0]["text"], "length")
        before = [successes(w0), successes(w1)]
        for i in range(4):
            completion(router, f"request number {i}", max_tokens=2)
        after = [successes(w0), successes(w1)]
        assert [a - b for a, b in zip(after, before)] == [2, 2]  # round robin: each worker got half
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    assert rc == 0
    wait_gone(pids)


@pytest.mark.slow  # its own deployment (two workers and the router): ~20 s on an idle box, more under load;
# test_kv_events.py pins the wire shape this router decodes in every run
def test_kv_aware_routes_a_cached_prefix_then_a_dead_worker_stops_everything(tmp_path_factory):
    """vllm-router's ``kv_aware`` policy over two workers publishing KV events (``--kv-events``): a prefix that
    one worker alone computed is routed to that worker every time, and the router's own counters say its index
    lookups hit. (Plain request bodies: with ``return_token_ids`` in one, vllm-router 0.1.17 makes no index lookup
    at all; ``temperature`` is fine.)

    Then the same deployment ends the other way round robin's does not: a worker killed with SIGKILL takes the
    whole deployment down with exit code 1, router and the other worker included (the launcher watches its
    workers whatever the policy; a deployment of its own for this cost a second start of two workers)."""
    def plain(url, prompt):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text

    ckpt = shared_checkpoint(tmp_path_factory)
    proc, info = launch(ckpt, "--policy", "kv_aware", "--kv-events")
    pids = [info["router_pid"], *info["worker_pids"]]
    try:
        router, (w0, w1) = info["router"], info["workers"]
        # Each worker computes one prefix, sent to it directly (a tie between idle workers goes either way).
        prefixes = {w: f"a long shared system prompt ({n}) that several requests repeat, word for word. " * 2
                    for n, w in enumerate((w0, w1))}
        for w, prefix in prefixes.items():
            plain(w, prefix + "the first question")
        time.sleep(1.0)  # the stored-block events reach the router's index (ZeroMQ on 127.0.0.1: milliseconds)
        for w, prefix in reversed(prefixes.items()):
            before = [successes(w0), successes(w1)]
            for i in range(2):
                plain(router, prefix + f"follow-up number {i}")
            got = [successes(w0) - before[0], successes(w1) - before[1]]
            assert got == ([2, 0] if w == w0 else [0, 2]), (w, got)
        lookups = {line.split("result=")[1].split("}")[0].strip('"'): float(line.split()[-1])
                   for line in httpx.get(info["router_metrics"], timeout=10).text.splitlines()
                   if line.startswith("vllm_router_kv_placement_lookups_total{")}
        assert lookups.get("hit", 0) >= 4, lookups

        # A dead worker stops everything.
        os.kill(info["worker_pids"][1], signal.SIGKILL)
        rc = proc.wait(30)
        assert rc == 1, f"a dead worker: the launcher exited with {rc}, not 1"
    finally:
        if proc.poll() is None:  # an assertion above failed: stop the deployment the clean way
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    wait_gone(pids)


def test_round_robin_through_sglang_router(tmp_path_factory):
    """``openinfer router --router sglang``: the real sglang-router (0.3.2 in the venv) in front of two tiny
    workers on 127.0.0.1; an answer through it is the worker's own, and round robin reaches both workers."""
    ckpt = shared_checkpoint(tmp_path_factory)
    proc, info = launch(ckpt, "--router", "sglang", "--policy", "round_robin")
    pids = [info["router_pid"], *info["worker_pids"]]
    try:
        router, (w0, w1) = info["router"], info["workers"]
        prompt = "the sglang router forwards this prompt"
        direct, via = completion(w0, prompt), completion(router, prompt)
        assert via["choices"][0]["text"] == direct["choices"][0]["text"]
        assert via["usage"]["completion_tokens"] == 8
        before = [successes(w0), successes(w1)]
        for i in range(4):
            completion(router, f"request number {i}", max_tokens=2)
        after = [successes(w0), successes(w1)]
        assert [a - b for a, b in zip(after, before)] == [2, 2]
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    assert rc == 0
    wait_gone(pids)
