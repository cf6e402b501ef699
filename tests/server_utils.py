"""Servers for the server tests: a real ``openinfer serve`` process on a free port (one per test module), or
the same app on a uvicorn thread of the test process where a second torch import buys nothing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def shared_checkpoint(tmp_path_factory) -> Path:
    """One tiny random Llama (char tokenizer, 1024 positions) per test session, shared by the server
    modules."""
    from helpers import make_dense_checkpoint

    path = tmp_path_factory.getbasetemp() / "server-tiny-llama"
    if not (path / "config.json").is_file():
        make_dense_checkpoint(path, "llama", vocab_size=256, max_position_embeddings=1024)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Endpoint:
    port: int
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(
            base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw
        )

    def metrics(self) -> dict[str, float]:
        """``{'name{label="v",...}': value}`` with labels sorted; model_name dropped."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        raise NotImplementedError


class ServerProcess(_Endpoint):
    def __init__(
        self,
        model: str | Path,
        *args: str,
        api_key: str | None = None,
        startup_timeout_s: float = 120.0,
        wait: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.api_key = api_key
        # A file of its own: a port is reused by later runs, and by runs of other checkouts at the same time.
        fd, name = tempfile.mkstemp(prefix=f"openinfer-test-server-{self.port}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        cmd = [sys.executable, "-m", "openinfer", "serve", "--model", str(model)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.startup_timeout_s = startup_timeout_s
        if wait:
            self.wait_ready()

    def wait_ready(self) -> ServerProcess:
        """Poll /health/ready; on failure kill the process and raise with its log."""
        try:
            deadline = time.monotonic() + self.startup_timeout_s
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    if httpx.get(self.url + "/health/ready", timeout=1.0).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server not ready after {self.startup_timeout_s}s:\n{self.log()}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()[-5000:]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                # A killed process with rank children and a NIXL agent can take a while on a loaded host: CI twice
                # saw a PD decode server (DeepSeek-V4 shape) still in state R, one thread, 30 s after SIGKILL, its
                # log ending at "drain complete" (not reproduced alone: it exits in < 1 s). SIGKILL was delivered;
                # what is left is the kernel's exit on a starved host, so wait for it longer than for a drain.
                try:
                    self.proc.wait(90)
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"server pid {self.proc.pid} alive 90 s after SIGKILL: "
                                       f"{_proc_state(self.proc.pid)}\n{self.log()}") from None
        self._log.close()


class InProcessServer(_Endpoint):
    """The same app served by uvicorn on a thread of the test process: real HTTP on a real port, without a
    second torch import (the test process already has one)."""

    def __init__(
        self,
        model: str | Path,
        served_model_names: tuple[str, ...] = ("tiny",),
        api_key: str | None = None,
        max_queue: int = 1024,
        max_body_bytes: int = 8 * 1024 * 1024,
        server_kw: dict | None = None,
        **engine_kw,
    ) -> None:
        import uvicorn

        from openinfer.engine_args import EngineArgs
        from openinfer.entrypoints.llm import build_engine
        from openinfer.server.api import build_app
        from openinfer.server.serving import ServerSettings

        self.api_key = api_key
        self.engine = build_engine(EngineArgs.from_kwargs("InProcessServer()", model=str(model), **engine_kw))
        settings = ServerSettings(list(served_model_names), api_key, max_queue, max_body_bytes, **(server_kw or {}))
        self.app = build_app(self.engine, settings)
        self.port = free_port()
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "in-process server did not start"
            time.sleep(0.02)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def run_coroutine(self, coro, timeout_s: float = 60.0):
        """Run ``coro`` on the server's event loop and wait for its result."""
        import asyncio

        loop = self.app.state.async_engine._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _proc_state(pid: int) -> str:
    """What the kernel says a process is doing (state and wait channel), for a process that will not die."""
    try:
        stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        wchan = open(f"/proc/{pid}/wchan").read()
        threads = {t: open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
                   for t in os.listdir(f"/proc/{pid}/task")}
        return f"state {stat}, wchan {wchan}, threads {threads}"
    except OSError as e:
        return f"(/proc unreadable: {e})"
