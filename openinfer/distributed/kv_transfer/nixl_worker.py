"""The NixlConnector's worker side: registers the KV stores with a NIXL agent, answers handshakes (side_channel.py)
and pulls remote prompts' blocks with NIXL READ.

Pull, as vLLM's NixlConnector: for each load the scheduler side hands over, the handshake with the producer runs
on a background thread (once per producer); then one READ moves every (group, store, block) the load names, and
carries the producer's request id as its completion notification: the producer frees those blocks when it
arrives. A load that fails (handshake refused or timed out, a layout that does not match, a transfer error) or
outlives ``load_timeout_s`` is reported failed, after telling the producer to free its blocks when it can still be
reached; the scheduler then computes the prompt locally.

Everything here runs on the engine's thread, between steps, except the handshakes.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from openinfer.config import KVTransferConfig
from openinfer.distributed.kv_transfer.base import KVConnectorWorker
from openinfer.distributed.kv_transfer.side_channel import HandshakeReply, SideChannelServer, StoreLayout, handshake
from openinfer.step_io import KVConnectorMetadata, KVConnectorOutput, KVLoad

logger = logging.getLogger(__name__)


@dataclass
class _Remote:
    agent_name: str
    groups: list[list[StoreLayout]]


def _check_layout(reply: HandshakeReply, mine: list[list[StoreLayout]]) -> None:
    if len(reply.groups) != len(mine) or any(
            len(r) != len(m) or any(a.block_bytes != b.block_bytes for a, b in zip(r, m))
            for r, m in zip(reply.groups, mine)):
        raise RuntimeError(f"producer {reply.engine_id}'s KV layout differs from this instance's (another model, "
                           f"dtype or block size)")


@dataclass
class _Load:
    spec: KVLoad
    deadline: float
    handshake: Future | None = None
    handle: object | None = None
    nbytes: int = 0
    started_s: float = field(default_factory=time.monotonic)


class NixlConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, engine_id: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.config = config
        self.engine_id = engine_id
        self.agent = nixl_agent(engine_id, nixl_agent_config(backends=["UCX"]))
        self.layout: list[list[StoreLayout]] = []
        self.server: SideChannelServer | None = None
        self._remotes: dict[str, _Remote] = {}  # producer engine id -> its agent and layout
        self._handshakes: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-handshake")
        self._loads: dict[str, _Load] = {}

    def register_kv_caches(self, groups: dict[str, list[torch.Tensor]]) -> dict:
        tensors = [t for ts in groups.values() for t in ts]
        self.agent.register_memory(tensors)
        self.layout = [[StoreLayout(t.data_ptr(), t.stride(0) * t.element_size(), t.shape[0]) for t in ts]
                       for ts in groups.values()]
        self.server = SideChannelServer(self.config.side_channel_host, self.config.side_channel_port, self.engine_id,
                                        self.agent.get_agent_metadata(), self.layout)
        logger.info("KV connector %s (%s): side channel on %s:%d, %d stores registered", self.engine_id,
                    self.config.kv_role, self.server.host, self.server.port, len(tensors))
        return {"host": self.server.host, "port": self.server.port}

    # -- loads ----------------------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if meta is None:
            return
        now = time.monotonic()
        for spec in meta.loads:
            load = _Load(spec, now + self.config.load_timeout_s)
            if spec.remote_engine_id not in self._remotes:
                fut = self._handshakes.get(spec.remote_engine_id)
                if fut is None or (fut.done() and fut.exception() is not None):
                    fut = self._pool.submit(self._handshake, spec)
                    self._handshakes[spec.remote_engine_id] = fut
                load.handshake = fut
            self._loads[spec.req_id] = load

    def _handshake(self, spec: KVLoad) -> HandshakeReply:
        """On the handshake thread: ZeroMQ only. The agent is touched on the engine's thread alone (NIXL's
        default sync mode is not thread-safe), which adds the remote agent when the reply is in."""
        reply = handshake(spec.remote_host, spec.remote_port, self.engine_id, spec.remote_engine_id,
                          min(5.0, self.config.load_timeout_s))
        _check_layout(reply, self.layout)
        return reply

    def _descs(self, spec: KVLoad, remote: _Remote) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        local_d, remote_d = [], []
        for local_ids, remote_ids, mine, theirs in zip(spec.local_block_ids, spec.remote_block_ids, self.layout,
                                                       remote.groups):
            if len(local_ids) != len(remote_ids):
                raise RuntimeError("local and remote block lists differ in length")
            for l, r in zip(local_ids, remote_ids):
                if l < 0 or r < 0:
                    continue
                for m, t in zip(mine, theirs):
                    if r >= t.num_blocks or l >= m.num_blocks:
                        raise RuntimeError(f"block id out of range (local {l}, remote {r})")
                    local_d.append((m.base_addr + l * m.block_bytes, m.block_bytes, 0))
                    remote_d.append((t.base_addr + r * t.block_bytes, t.block_bytes, 0))
        return local_d, remote_d

    def _start_read(self, load: _Load, remote: _Remote) -> str:
        local_d, remote_d = self._descs(load.spec, remote)
        notif = load.spec.remote_request_id.encode()
        if not local_d:  # nothing to move (all positions local or released): just let the producer free
            self.agent.send_notif(remote.agent_name, notif)
            return "DONE"
        load.nbytes = sum(n for _, n, _ in local_d)
        load.handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local_d, "DRAM"),
                                                 self.agent.get_xfer_descs(remote_d, "DRAM"), remote.agent_name,
                                                 notif)
        load.started_s = time.monotonic()
        return self.agent.transfer(load.handle)

    def _fail(self, load: _Load, why: str, out: KVConnectorOutput) -> None:
        out.failed_recving[load.spec.req_id] = why
        remote = self._remotes.get(load.spec.remote_engine_id)
        if load.handle is not None:
            try:
                self.agent.release_xfer_handle(load.handle)
            except Exception:  # an aborted in-flight read; nothing more to do with it
                logger.debug("releasing a failed transfer's handle", exc_info=True)
        if remote is not None:
            try:  # the producer frees its held blocks now rather than at its timeout
                self.agent.send_notif(remote.agent_name, load.spec.remote_request_id.encode())
            except Exception:
                logger.debug("could not notify producer %s", load.spec.remote_engine_id, exc_info=True)

    def _progress(self, load: _Load, now: float, out: KVConnectorOutput) -> bool:
        """Advance one load; True when it is over (finished or failed)."""
        spec = load.spec
        try:
            if load.handle is None:
                if spec.remote_engine_id not in self._remotes:
                    if not load.handshake.done():
                        if now > load.deadline:
                            self._fail(load, "handshake timed out", out)
                            return True
                        return False
                    reply = load.handshake.result()
                    self._remotes[spec.remote_engine_id] = _Remote(self.agent.add_remote_agent(reply.agent_metadata),
                                                                   reply.groups)
                state = self._start_read(load, self._remotes[spec.remote_engine_id])
                if load.handle is None:
                    out.finished_recving.append(spec.req_id)
                    return True
            else:
                state = self.agent.check_xfer_state(load.handle)
        except Exception as e:
            logger.warning("request %s: KV read from %s failed: %s", spec.req_id, spec.remote_engine_id, e)
            self._fail(load, f"{type(e).__name__}: {e}", out)
            return True
        if state == "DONE":
            out.finished_recving.append(spec.req_id)
            out.bytes_received += load.nbytes
            out.seconds_receiving += time.monotonic() - load.started_s
            self.agent.release_xfer_handle(load.handle)
            return True
        if state == "ERR":
            self._fail(load, "NIXL transfer error", out)
            return True
        if now > load.deadline:
            self._fail(load, f"transfer not done within {self.config.load_timeout_s:.1f} s", out)
            return True
        return False

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        now = time.monotonic()
        for rid in [rid for rid, load in self._loads.items() if self._progress(load, now, out)]:
            del self._loads[rid]
        # Producer: readers' completion notifications name the requests whose blocks can go.
        for msgs in self.agent.get_new_notifs().values():
            out.finished_sending += [m.decode() for m in msgs]
        return out

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self._pool.shutdown(wait=False, cancel_futures=True)
