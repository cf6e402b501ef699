"""The NixlConnector's worker side: registers the KV stores with a NIXL agent, answers handshakes (side_channel.py)
and pulls remote prompts' blocks with NIXL READ - or, with send_type PUT, registers its blocks with the producer,
which writes into them (nixl_push.py) and notifies when they are full.

Pull, as vLLM's NixlConnector: for each load the scheduler side hands over, the handshake with the producer runs
on a background thread (once per producer rank); then one READ moves every (group, store, block) the load names, and
carries the producer's request id as its completion notification: the producer frees those blocks when it
arrives. A load that fails (handshake refused or timed out, a layout that does not match, a transfer error) or
outlives ``load_timeout_s`` is reported failed, after telling the producer to free its blocks when it can still be
reached; the scheduler then computes the prompt locally. A failed read is reported (and its blocks reused) only
once its transfer is over: NIXL's release_xfer_handle aborts an active transfer or, when it cannot, raises and
keeps it - then the read stays here, released again every step, until NIXL lets it go (or it completes).

Push loads: the registration goes out on the handshake thread; then the load waits for the producer's completion
(or failure) notification. A refusal fails it at once (nothing will be written); no answer or no notification
within twice ``load_timeout_s`` (the producer gives up its write after one) fails it too.

One of these runs on every rank of an instance (ranks.py), over that rank's stores: its agent is named after its
replica and tensor-parallel rank, and it pairs with the other side's ranks as ``_pairing`` says (rank i with rank i;
across sizes, where every rank holds the whole KV, rank i reads rank i mod P and tells the producer ranks nobody
reads). Handshakes are per producer rank.

Everything here runs on the engine's thread (the worker process's), between steps, except the handshakes and push
registrations (ZeroMQ only) and the side channel's listener.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from openinfer.config import KVTransferConfig
from openinfer.distributed.kv_transfer.base import KVConnectorWorker
from openinfer.distributed.kv_transfer.ranks import agent_name
from openinfer.distributed.kv_transfer.nixl_push import PUSH_DONE, PUSH_FAIL, PushWriter, block_descs, layout_mismatch
from openinfer.distributed.kv_transfer.side_channel import (HandshakeReply, PushRefused, PushRequest,
                                                            SideChannelServer, StoreLayout, handshake, register_push)
from openinfer.step_io import KVConnectorMetadata, KVConnectorOutput, KVLoad

logger = logging.getLogger(__name__)


@dataclass
class _Remote:
    agent_name: str
    groups: list[list[StoreLayout]]
    settings: str = ""


@dataclass
class _Load:
    spec: KVLoad
    deadline: float
    handshakes: dict[int, Future] = field(default_factory=dict)  # producer rank -> its handshake, while pending
    handle: object | None = None
    nbytes: int = 0
    started_s: float = field(default_factory=time.monotonic)
    failed: str = ""  # a failed read whose transfer NIXL has not released yet


@dataclass
class _PushLoad:
    spec: KVLoad
    deadline: float
    registered: Future
    nbytes: int
    started_s: float = field(default_factory=time.monotonic)


class NixlConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, engine_id: str, settings: str = "", tp_rank: int = 0,
                 tp_size: int = 1, rank: int = 0) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.config = config
        self.engine_id = engine_id  # this rank's replica's (ranks.replica_engine_id)
        self.settings = settings  # this instance's layout-shaping settings, for both sides' error messages
        # Tensor-parallel rank i reads from (or is written by) rank i of the other side (ranks.py).
        self.tp_rank, self.tp_size, self.rank = tp_rank, tp_size, rank
        self.agent_name = agent_name(engine_id, tp_rank, tp_size)
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(backends=["UCX"]))
        self.layout: list[list[StoreLayout]] = []
        self.server: SideChannelServer | None = None
        self._remotes: dict[tuple[str, int], _Remote] = {}  # (producer engine id, rank) -> its agent and layout
        self._handshakes: dict[tuple[str, int], Future] = {}
        self._notices: dict[str, int] = {}  # producer: completion notices heard so far, where several are due
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-handshake")
        self._loads: dict[str, _Load] = {}
        self._push_loads: dict[str, _PushLoad] = {}
        self.pusher: PushWriter | None = None
        self._metadata = b""

    def register_kv_caches(self, groups: dict[str, list[torch.Tensor]]) -> dict:
        tensors = [t for ts in groups.values() for t in ts]
        self.agent.register_memory(tensors)
        self.layout = [[StoreLayout(t.data_ptr(), t.stride(0) * t.element_size(), t.shape[0]) for t in ts]
                       for ts in groups.values()]
        self._metadata = self.agent.get_agent_metadata()
        if self.config.is_producer:
            self.pusher = PushWriter(self.agent, self.layout, self.config, self.settings)
        # A fixed side-channel port is the first rank's; rank r listens on port + r (vLLM's scheme).
        port = self.config.side_channel_port + self.rank if self.config.side_channel_port else 0
        self.server = SideChannelServer(self.config.side_channel_host, port, self.engine_id,
                                        self._metadata, self.layout,
                                        on_push=self.pusher.on_push if self.pusher is not None else None,
                                        settings=self.settings)
        logger.info("KV connector %s (%s): side channel on %s:%d, %d stores registered", self.engine_id,
                    self.config.kv_role, self.server.host, self.server.port, len(tensors))
        return {"host": self.server.host, "port": self.server.port}

    # -- loads ----------------------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if meta is None:
            return
        if self.pusher is not None:
            self.pusher.held.update(meta.held)
            for rid in meta.released:
                self.pusher.held.pop(rid, None)
        now = time.monotonic()
        for spec in meta.loads:
            if spec.push:
                self._start_push(spec, now)
                continue
            load = _Load(spec, now + self.config.load_timeout_s)
            read_rank, notify, _ = self._pairing(spec)
            for r in {read_rank, *notify}:
                key = (spec.remote_engine_id, r)
                if key not in self._remotes:
                    fut = self._handshakes.get(key)
                    if fut is None or (fut.done() and fut.exception() is not None):
                        fut = self._pool.submit(self._handshake, spec, r)
                        self._handshakes[key] = fut
                    load.handshakes[r] = fut
            self._loads[spec.req_id] = load

    def _remote_port(self, spec: KVLoad, producer_rank: int | None = None) -> int:
        """The side channel of a producer rank (by default the one this rank pairs with; its first rank's without
        per-rank ports)."""
        r = self.tp_rank if producer_rank is None else producer_rank
        return spec.remote_ports[r] if spec.remote_ports else spec.remote_port

    def _pairing(self, spec: KVLoad) -> tuple[int, list[int], int]:
        """(the producer rank this rank reads from, the producer ranks it tells the prompt is read, how many such
        notices each producer rank gets in all). The same tensor_parallel_size: rank i <-> rank i. Otherwise
        (allowed only where every rank holds the whole KV, ranks.py): rank i reads rank i mod P; a producer rank
        no decoder rank reads hears from rank j mod D; a producer rank several read from hears from each."""
        p, d, i = max(1, len(spec.remote_ports)), self.tp_size, self.tp_rank
        if p == d:
            return i, [i], 1
        notify = sorted({i % p, *(r for r in range(p) if r % d == i)})
        return i % p, notify, max(1, d // p)

    def _handshake(self, spec: KVLoad, producer_rank: int) -> HandshakeReply:
        """On the handshake thread: ZeroMQ only. The agent is touched on the engine's thread alone (NIXL's
        default sync mode is not thread-safe), which adds the remote agent when the reply is in."""
        return handshake(spec.remote_host, self._remote_port(spec, producer_rank), self.agent_name,
                         spec.remote_engine_id, min(5.0, self.config.load_timeout_s))

    def _notice(self, spec: KVLoad) -> bytes:
        """The completion notice a producer rank gets: the request id, and how many notices it waits for when
        several decoder ranks read its copy."""
        n = self._pairing(spec)[2]
        return spec.remote_request_id.encode() + (b"\x00%d" % n if n > 1 else b"")

    def _descs(self, spec: KVLoad, remote: _Remote) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        return block_descs(spec.local_block_ids, spec.remote_block_ids, self.layout, remote.groups)

    def _start_read(self, load: _Load, remote: _Remote) -> str:
        # Checked here, not on the handshake thread: with the producer's agent added, a read refused for its
        # layout still tells the producer to free the prompt it holds (_fail).
        why = layout_mismatch(remote.groups, remote.settings, self.layout, self.settings,
                              f"producer {load.spec.remote_engine_id}")
        if why:
            raise RuntimeError(why)
        local_d, remote_d = self._descs(load.spec, remote)
        notif = self._notice(load.spec)
        if not local_d:  # nothing to move (all positions local or released): just let the producer free
            self.agent.send_notif(remote.agent_name, notif)
            return "DONE"
        load.nbytes = sum(n for _, n, _ in local_d)
        load.handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local_d, "DRAM"),
                                                 self.agent.get_xfer_descs(remote_d, "DRAM"), remote.agent_name,
                                                 notif)
        load.started_s = time.monotonic()
        return self.agent.transfer(load.handle)

    def _fail(self, load: _Load, why: str, out: KVConnectorOutput) -> bool:
        """Report the load failed once its transfer is released (aborted if still active); False: NIXL could not
        release it yet - it may still write into the blocks, so they stay the request's and this is retried."""
        load.failed = why
        if load.handle is not None:
            try:
                self.agent.release_xfer_handle(load.handle)
            except Exception:
                logger.debug("request %s: read not released yet", load.spec.req_id, exc_info=True)
                return False
            load.handle = None
        out.failed_recving[load.spec.req_id] = why
        self._notify_others(load.spec, skip=None)  # the producer frees its held blocks now, not at its timeout
        return True

    def _notify_others(self, spec: KVLoad, skip: int | None) -> None:
        """Tell the producer ranks this rank answers for (but ``skip``, whose read carried the notice) that the
        prompt is read; a rank not reached yet frees at its abort timeout."""
        for r in self._pairing(spec)[1]:
            remote = self._remotes.get((spec.remote_engine_id, r))
            if r == skip or remote is None:
                continue
            try:
                self.agent.send_notif(remote.agent_name, self._notice(spec))
            except Exception:
                logger.debug("could not notify producer %s rank %d", spec.remote_engine_id, r, exc_info=True)

    def _progress(self, load: _Load, now: float, out: KVConnectorOutput) -> bool:
        """Advance one load; True when it is over (finished or failed)."""
        spec = load.spec
        if load.failed:  # waiting for NIXL to let go of a failed read's transfer
            return self._fail(load, load.failed, out)
        try:
            if load.handle is None:
                for r, fut in list(load.handshakes.items()):
                    key = (spec.remote_engine_id, r)
                    if key not in self._remotes:
                        if not fut.done():
                            if now > load.deadline:
                                return self._fail(load, f"handshake with rank {r} timed out", out)
                            return False
                        reply = fut.result()
                        self._remotes[key] = _Remote(self.agent.add_remote_agent(reply.agent_metadata),
                                                     reply.groups, reply.settings)
                    del load.handshakes[r]
                read_rank = self._pairing(spec)[0]
                state = self._start_read(load, self._remotes[(spec.remote_engine_id, read_rank)])
                if load.handle is None:
                    self._notify_others(spec, skip=read_rank)
                    out.finished_recving.append(spec.req_id)
                    return True
            else:
                state = self.agent.check_xfer_state(load.handle)
        except Exception as e:
            logger.warning("request %s: KV read from %s failed: %s", spec.req_id, spec.remote_engine_id, e)
            return self._fail(load, f"{type(e).__name__}: {e}", out)
        if state == "DONE":
            self._notify_others(spec, skip=self._pairing(spec)[0])
            out.finished_recving.append(spec.req_id)
            out.bytes_received += load.nbytes
            out.seconds_receiving += time.monotonic() - load.started_s
            self.agent.release_xfer_handle(load.handle)
            return True
        if state == "ERR":
            return self._fail(load, "NIXL transfer error", out)
        if now > load.deadline:
            return self._fail(load, f"transfer not done within {self.config.load_timeout_s:.1f} s", out)
        return False

    # -- push loads (send_type PUT) ------------------------------------------------------------------------
    def _start_push(self, spec: KVLoad, now: float) -> None:
        nbytes = sum(sum(s.block_bytes for s in stores) for ids, rids, stores in
                     zip(spec.local_block_ids, spec.remote_block_ids, self.layout)
                     for lb, rb in zip(ids, rids) if lb >= 0 and rb >= 0)
        req = PushRequest(self.agent_name, spec.remote_engine_id, self._metadata, self.layout, spec.req_id,
                          spec.remote_request_id, spec.local_block_ids, settings=self.settings)
        fut = self._pool.submit(register_push, spec.remote_host, self._remote_port(spec), req,
                                min(5.0, self.config.load_timeout_s))
        self._push_loads[spec.req_id] = _PushLoad(spec, now + 2 * self.config.load_timeout_s, fut, nbytes)

    def _progress_push(self, load: _PushLoad, notes: dict[tuple[str, str], bool], now: float,
                       out: KVConnectorOutput) -> bool:
        spec = load.spec
        done = notes.pop((agent_name(spec.remote_engine_id, self.tp_rank, self.tp_size), spec.req_id), None)
        if done is True:
            out.finished_recving.append(spec.req_id)
            out.bytes_received += load.nbytes
            out.seconds_receiving += now - load.started_s
            return True
        if done is False:
            out.failed_recving[spec.req_id] = "the producer could not write the prompt's KV"
            return True
        if load.registered.done() and isinstance(load.registered.exception(), PushRefused):
            # Refused: the producer took nothing and writes nothing.
            logger.warning("request %s: %s", spec.req_id, load.registered.exception())
            out.failed_recving[spec.req_id] = str(load.registered.exception())
            return True
        if now > load.deadline:
            # No answer or no notification: the producer is gone or gave up its write (after load_timeout_s).
            logger.warning("request %s: no push from %s within %.1f s", spec.req_id, spec.remote_engine_id,
                           2 * self.config.load_timeout_s)
            out.failed_recving[spec.req_id] = "push not done in time"
            return True
        return False

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        now = time.monotonic()
        for rid in [rid for rid, load in self._loads.items() if self._progress(load, now, out)]:
            del self._loads[rid]
        if self.pusher is not None:  # producer: writes for decoders that registered their blocks
            self.pusher.step(out)
        notes: dict[tuple[str, str], bool] = {}  # (producer engine, request) -> pushed ok
        for agent_name, msgs in self.agent.get_new_notifs().items():
            name = agent_name.decode() if isinstance(agent_name, bytes) else agent_name
            for m in msgs:
                if m.startswith(PUSH_DONE) or m.startswith(PUSH_FAIL):
                    notes[(name, m[len(PUSH_DONE):].decode())] = m.startswith(PUSH_DONE)
                else:  # producer: a reader's completion names the request whose blocks can go
                    rid, _, need = m.decode().partition("\x00")
                    heard = self._notices.get(rid, 0) + 1  # several decoder ranks may read this rank's copy
                    if heard < int(need or 1):
                        self._notices[rid] = heard
                        continue
                    self._notices.pop(rid, None)
                    out.finished_sending.append(rid)
                    if self.pusher is not None:
                        self.pusher.held.pop(rid, None)
        for rid in [rid for rid, load in self._push_loads.items() if self._progress_push(load, notes, now, out)]:
            del self._push_loads[rid]
        return out

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self._pool.shutdown(wait=False, cancel_futures=True)
