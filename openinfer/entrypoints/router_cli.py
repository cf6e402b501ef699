"""``openinfer router``: a balanced (or prefill/decode disaggregated) deployment from one command.

Load balancing lives outside the engine, in the routers people already run: this only launches one. Given worker
URLs (``--worker-urls``), or ``--start-workers N --model M`` (N ``openinfer serve`` processes on free ports), it
starts ``vllm-router`` (default) or ``sglang-router`` with the right flags, waits until every worker and the router
answer ``/health``, prints one JSON line saying where everything is, then supervises: SIGTERM / SIGINT go to every
child (workers drain), and if the router or a started worker dies the rest are stopped and the launcher exits 1.
Children also get SIGTERM from the kernel if the launcher itself is killed (PR_SET_PDEATHSIG), so none is orphaned.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)

ROUTERS = {"vllm": "vllm-router", "sglang": "sglang-router"}
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.2


def add_parser(sub) -> None:
    p = sub.add_parser(
        "router",
        help="run vllm-router / sglang-router in front of openinfer workers (optionally starting them)",
        description=__doc__.split("\n\n")[1],
    )
    w = p.add_argument_group("workers")
    w.add_argument("--worker-urls", nargs="+", default=[], metavar="URL", help="workers already running")
    w.add_argument("--start-workers", type=int, default=0, metavar="N",
                   help="start N 'openinfer serve' workers on free ports of --worker-host")
    w.add_argument("--model", help="the model the started workers serve")
    w.add_argument("--worker-host", default="127.0.0.1")
    w.add_argument("--worker-args", default="",
                   help="more 'openinfer serve' arguments for every started worker, as one shell-quoted string")
    w.add_argument("--worker-log-dir", default=None, help="write each started worker's output to a file here")
    w.add_argument("--kv-events", action="store_true",
                   help="started workers publish KV cache events (tcp://*:PORT) and vllm-router subscribes to them "
                   "(needs --policy kv_aware)")
    r = p.add_argument_group("router")
    r.add_argument("--router", choices=sorted(ROUTERS), default="vllm", help="which router (default: vllm)")
    r.add_argument("--host", default="127.0.0.1", help="the router's interface")
    r.add_argument("--port", type=int, default=30000, help="the router's port")
    r.add_argument("--policy", default=None,
                   help="load-balancing policy, passed through: round_robin, cache_aware, power_of_two, random, "
                   "kv_aware (vllm-router), consistent_hash ... (default: the router's own, cache_aware)")
    r.add_argument("--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
                   help="prefill worker (PD disaggregation; repeat per worker), passed through")
    r.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="decode worker (PD disaggregation; repeat per worker), passed through")
    r.add_argument("--router-args", default="", help="more router arguments, as one shell-quoted string")
    r.add_argument("--startup-timeout-s", type=float, default=300.0,
                   help="how long workers and the router may take to answer /health")
    r.add_argument("--stop-timeout-s", type=float, default=40.0,
                   help="on shutdown, how long children may take to exit (workers drain) before they are killed")
    p.set_defaults(func=run)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies, however it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not glibc Linux: the signal forwarding still covers a clean stop
        pass


def router_executable(name: str) -> str:
    """The router's console script: next to this interpreter (a venv) or on PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise ValueError(f"{name} is not installed (pip install {name.replace('-', '_')}; see README)")
    return found


def check_args(args: argparse.Namespace) -> None:
    """Every flag error before anything starts."""
    pd = bool(args.prefill or args.decode)
    if args.start_workers < 0:
        raise ValueError(f"--start-workers must be >= 0, got {args.start_workers}")
    if args.start_workers and not args.model:
        raise ValueError("--start-workers needs --model")
    if pd and not (args.prefill and args.decode):
        raise ValueError("PD disaggregation needs both --prefill and --decode")
    if pd and (args.worker_urls or args.start_workers):
        raise ValueError("--worker-urls / --start-workers and --prefill / --decode are exclusive")
    if not pd and not (args.worker_urls or args.start_workers):
        raise ValueError("no workers: give --worker-urls, --start-workers N, or --prefill and --decode")
    for pre in args.prefill:
        if len(pre) > 2:
            raise ValueError(f"--prefill takes a URL and an optional bootstrap port, got {pre}")
    if args.kv_events and (args.router != "vllm" or args.policy != "kv_aware" or not args.start_workers):
        raise ValueError("--kv-events needs --start-workers, --router vllm and --policy kv_aware")
    router_executable(ROUTERS[args.router])


def router_command(args: argparse.Namespace, workers: list[str], prometheus_port: int,
                   kv_sources: dict[str, str] | None = None, kv_block_size: int | None = None) -> list[str]:
    """The router's command line for ``args`` (pure: tested without starting anything)."""
    exe = router_executable(ROUTERS[args.router])
    cmd = [exe] + (["launch"] if args.router == "sglang" else [])
    cmd += ["--host", args.host, "--port", str(args.port), "--prometheus-port", str(prometheus_port),
            "--worker-startup-check-interval", "1"]
    if args.prefill or args.decode:
        cmd.append("--vllm-pd-disaggregation" if args.router == "vllm" else "--pd-disaggregation")
        for pre in args.prefill:
            cmd += ["--prefill", *pre]
        for dec in args.decode:
            cmd += ["--decode", dec]
    else:
        cmd += ["--worker-urls", *workers]
    if args.policy:
        cmd += ["--policy", args.policy]
    for url, endpoint in (kv_sources or {}).items():
        cmd += ["--kv-event-source", f"{url}={endpoint}"]
    if kv_sources:
        cmd += ["--kv-event-model", args.model, "--kv-event-block-size", str(kv_block_size or 16)]
    return cmd + shlex.split(args.router_args)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    url: str | None = None
    log: object | None = None


@dataclass
class Launcher:
    args: argparse.Namespace
    children: list[Child] = field(default_factory=list)
    stopping: bool = False

    def spawn(self, name: str, cmd: list[str], url: str | None, log_path: str | None) -> Child:
        log = open(log_path, "w") if log_path else None
        logger.info("starting %s: %s", name, shlex.join(cmd))
        proc = subprocess.Popen(cmd, stdout=log or sys.stderr, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True,  # signals reach children only through us
                                preexec_fn=_die_with_parent, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        child = Child(name, proc, url, log)
        self.children.append(child)
        return child

    def start_workers(self) -> tuple[list[str], dict[str, str]]:
        a = self.args
        urls, kv_sources = [], {}
        for i in range(a.start_workers):
            port = free_port(a.worker_host)
            url = f"http://{a.worker_host}:{port}"
            cmd = [sys.executable, "-m", "openinfer", "serve", "--model", a.model, "--host", a.worker_host,
                   "--port", str(port), *shlex.split(a.worker_args)]
            if a.kv_events:
                kv_port = free_port(a.worker_host)
                cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_port}",
                       "topic": ""}  # vLLM's default, what the router subscribes to
                cmd += ["--kv-events-config", json.dumps(cfg)]
                kv_sources[url] = f"tcp://{a.worker_host}:{kv_port}"
            log = None
            if a.worker_log_dir:
                os.makedirs(a.worker_log_dir, exist_ok=True)
                log = os.path.join(a.worker_log_dir, f"worker-{i}.log")
            self.spawn(f"worker {i} ({url})", cmd, url, log)
            urls.append(url)
        return urls, kv_sources

    def wait_healthy(self, url: str, what: str, deadline: float) -> None:
        while True:
            self.check_children()
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} at {url} did not answer /health within {self.args.startup_timeout_s}s")
            time.sleep(_POLL_S)

    def check_children(self) -> None:
        for c in self.children:
            rc = c.proc.poll()
            if rc is not None:
                raise ChildDied(f"{c.name} exited with code {rc}")

    def stop_all(self) -> None:
        """SIGTERM every child (workers drain, the router stops), then SIGKILL what is left at the deadline."""
        live = [c for c in self.children if c.proc.poll() is None]
        for c in live:
            c.proc.terminate()
        deadline = time.monotonic() + self.args.stop_timeout_s
        for c in live:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0fs: killing it", c.name, self.args.stop_timeout_s)
                c.proc.kill()
                c.proc.wait()
        for c in self.children:
            if c.log is not None:
                c.log.close()


class ChildDied(RuntimeError):
    pass


class _Stop(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    check_args(args)
    launcher = Launcher(args)

    def on_signal(sig, frame):
        if not launcher.stopping:
            launcher.stopping = True
            raise _Stop(signal.Signals(sig).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        started, kv_sources = launcher.start_workers()
        workers = list(args.worker_urls) + started
        deadline = time.monotonic() + args.startup_timeout_s
        for url in started:
            launcher.wait_healthy(url, "worker", deadline)
        prometheus_port = free_port()
        # The router hashes token blocks itself to match the events: it needs the workers' block size.
        block_size = httpx.get(started[0] + "/get_server_info", timeout=10).json()["block_size"] if kv_sources \
            else None
        cmd = router_command(args, workers, prometheus_port, kv_sources, block_size)
        router_url = f"http://{args.host}:{args.port}"
        router = launcher.spawn(f"{ROUTERS[args.router]} ({router_url})", cmd, router_url, None)
        launcher.wait_healthy(router_url, ROUTERS[args.router], deadline)
        ready = {"router": router_url, "router_pid": router.proc.pid, "workers": workers,
                 "router_metrics": f"http://127.0.0.1:{prometheus_port}/metrics",
                 "worker_pids": [c.proc.pid for c in launcher.children if c is not router],
                 "prefill": [p[0] for p in args.prefill], "decode": list(args.decode), "kv_event_sources": kv_sources}
        print(json.dumps(ready), flush=True)
        logger.info("router ready on %s in front of %d workers", router_url, len(workers) or len(args.decode))
        while True:
            launcher.check_children()
            time.sleep(_POLL_S)
    except _Stop as e:
        logger.info("received %s: stopping the router and the workers", e)
        launcher.stop_all()
        return 0
    except (ChildDied, TimeoutError) as e:
        logger.error("%s: stopping the rest", e)
        launcher.stopping = True
        launcher.stop_all()
        return 1
    except BaseException:
        launcher.stopping = True
        launcher.stop_all()
        raise
