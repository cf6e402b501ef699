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
replica and tensor-parallel rank, and it pairs with the other side's ranks as ``_pairing`` says (rank i with rank i
at the same tensor_parallel_size; across sizes, tp_slices.py: a split store's head slices from the producer ranks
holding them - one READ, or one push registration, per producer rank - and a whole store from rank i mod P).
Handshakes are per producer rank.

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
from openinfer.distributed.kv_transfer.nixl_agent import make_agent
from openinfer.distributed.kv_transfer.ranks import agent_name
from openinfer.distributed.kv_transfer.nixl_push import PUSH_DONE, PUSH_FAIL, PushWriter, layout_mismatch
from openinfer.distributed.kv_transfer.side_channel import (HandshakeReply, PushRefused, PushRequest,
                                                            SideChannelServer, StoreLayout, handshake, register_push)
from openinfer.distributed.kv_transfer.tp_slices import answers_for, notices_per_rank, sources, transfer_descs
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
    handles: dict[int, object] = field(default_factory=dict)  # producer rank -> its READ in flight
    started: bool = False
    done_ranks: set[int] = field(default_factory=set)  # producer ranks told (by their read's notice or ours)
    nbytes: int = 0
    started_s: float = field(default_factory=time.monotonic)
    failed: str = ""  # a failed read whose transfer NIXL has not released yet


@dataclass
class _PushLoad:
    spec: KVLoad
    deadline: float
    registered: dict[int, Future]  # producer rank -> its registration
    nbytes: int
    outcomes: dict[int, bool] = field(default_factory=dict)  # producer rank -> wrote (True) or failed
    refusal: str = ""
    started_s: float = field(default_factory=time.monotonic)


class NixlConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, engine_id: str, settings: str = "", tp_rank: int = 0,
                 tp_size: int = 1, rank: int = 0) -> None:
        self.config = config
        self.engine_id = engine_id  # this rank's replica's (ranks.replica_engine_id)
        self.settings = settings  # this instance's layout-shaping settings, for both sides' error messages
        # Tensor-parallel rank i reads from (or is written by) rank i of the other side (ranks.py).
        self.tp_rank, self.tp_size, self.rank = tp_rank, tp_size, rank
        self.agent_name = agent_name(engine_id, tp_rank, tp_size)
        self.agent = make_agent(self.agent_name, ["UCX"])
        self.layout: list[list[StoreLayout]] = []
        self.server: SideChannelServer | None = None
        self._remotes: dict[tuple[str, int], _Remote] = {}  # (producer engine id, rank) -> its agent and layout
        self._handshakes: dict[tuple[str, int], Future] = {}
        self._notices: dict[str, int] = {}  # producer: completion notices heard so far, where several are due
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-handshake")
        self._loads: dict[str, _Load] = {}
        self._push_loads: dict[str, _PushLoad] = {}
        self._push_agents: dict[str, dict[str, int]] = {}  # push load -> its producer ranks' agent names -> rank
        self.pusher: PushWriter | None = None
        self._metadata = b""

    def register_kv_caches(self, groups: dict[str, list[torch.Tensor]], rows: dict[int, int] | None = None) -> dict:
        """``rows``: id(tensor) -> token rows per block, for the stores split by KV heads over the ranks."""
        tensors = [t for ts in groups.values() for t in ts]
        self.agent.register_memory(tensors)
        rows = rows or {}
        self.layout = [[StoreLayout(t.data_ptr(), t.stride(0) * t.element_size(), t.shape[0], rows.get(id(t), 0))
                        for t in ts] for ts in groups.values()]
        self._metadata = self.agent.get_agent_metadata()
        if self.config.is_producer:
            self.pusher = PushWriter(self.agent, self.layout, self.config, self.settings, self.tp_rank, self.tp_size)
        # A fixed side-channel port is the first rank's; rank r listens on port + r (vLLM's scheme).
        port = self.config.side_channel_port + self.rank if self.config.side_channel_port else 0
        self.server = SideChannelServer(self.config.side_channel_host, port, self.engine_id,
                                        self._metadata, self.layout,
                                        on_push=self.pusher.on_push if self.pusher is not None else None,
                                        settings=self.settings, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                        on_release=self.pusher.on_push if self.pusher is not None else None)
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
            for r in self._pairing(spec)[1]:
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

    def _pairing(self, spec: KVLoad) -> tuple[list[int], list[int], int]:
        """(the producer ranks this rank takes bytes from, the producer ranks it answers for - tells the prompt is
        read, or registers with for push - and how many such answers each producer rank gets in all). The same
        tensor_parallel_size: rank i <-> rank i; otherwise tp_slices.py says who holds which slice."""
        p, d, i = max(1, len(spec.remote_ports)), self.tp_size, self.tp_rank
        split = any(s.rows for stores in self.layout for s in stores)
        return sources(p, d, i, split), answers_for(p, d, i, split), notices_per_rank(p, d)

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

    def _start_reads(self, load: _Load) -> None:
        """One READ per producer rank this rank takes bytes from (its slice of each of their rows, or their whole
        blocks), each carrying that rank's completion notice; a rank with nothing to give just gets the notice."""
        spec = load.spec
        p = max(1, len(spec.remote_ports))
        for r in self._pairing(spec)[0]:
            remote = self._remotes[(spec.remote_engine_id, r)]
            # Checked here, not on the handshake thread: with the producer's agent added, a read refused for its
            # layout still tells the producer to free the prompt it holds (_fail).
            why = layout_mismatch(remote.groups, remote.settings, p, self.layout, self.settings, self.tp_size,
                                  f"producer {spec.remote_engine_id}")
            if why:
                raise RuntimeError(why)
        load.started = True
        load.started_s = time.monotonic()
        for r in self._pairing(spec)[0]:
            remote = self._remotes[(spec.remote_engine_id, r)]
            remote_d, local_d = transfer_descs(spec.remote_block_ids, spec.local_block_ids, remote.groups, r, p,
                                               self.layout, self.tp_rank, self.tp_size)
            if not local_d:  # nothing to move (all positions local or released): just let the producer free
                self.agent.send_notif(remote.agent_name, self._notice(spec))
                load.done_ranks.add(r)
                continue
            load.nbytes += sum(n for _, n, _ in local_d)
            load.handles[r] = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local_d, "DRAM"),
                                                         self.agent.get_xfer_descs(remote_d, "DRAM"),
                                                         remote.agent_name, self._notice(spec))
            if self.agent.transfer(load.handles[r]) == "ERR":
                raise RuntimeError(f"NIXL read from rank {r} failed at post")

    def _fail(self, load: _Load, why: str, out: KVConnectorOutput) -> bool:
        """Report the load failed once its transfers are released (aborted if still active); False: NIXL could not
        release one yet - it may still write into the blocks, so they stay the request's and this is retried."""
        load.failed = why
        for r, handle in list(load.handles.items()):
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:
                logger.debug("request %s: read from rank %d not released yet", load.spec.req_id, r, exc_info=True)
                return False
            del load.handles[r]
        out.failed_recving[load.spec.req_id] = why
        self._notify_others(load)  # the producer frees its held blocks now, not at its timeout
        return True

    def _notify_others(self, load: _Load) -> None:
        """Tell the producer ranks this rank answers for (but those whose read carried the notice) that the prompt
        is read; a rank not reached yet frees at its abort timeout."""
        spec = load.spec
        for r in self._pairing(spec)[1]:
            remote = self._remotes.get((spec.remote_engine_id, r))
            if r in load.done_ranks or remote is None:
                continue
            try:
                self.agent.send_notif(remote.agent_name, self._notice(spec))
                load.done_ranks.add(r)
            except Exception:
                logger.debug("could not notify producer %s rank %d", spec.remote_engine_id, r, exc_info=True)

    def _progress(self, load: _Load, now: float, out: KVConnectorOutput) -> bool:
        """Advance one load; True when it is over (finished or failed)."""
        spec = load.spec
        if load.failed:  # waiting for NIXL to let go of a failed read's transfer
            return self._fail(load, load.failed, out)
        try:
            if not load.started:
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
                self._start_reads(load)
            for r, handle in list(load.handles.items()):
                state = self.agent.check_xfer_state(handle)
                if state == "DONE":
                    self.agent.release_xfer_handle(handle)
                    del load.handles[r]
                    load.done_ranks.add(r)
                elif state == "ERR":
                    return self._fail(load, f"NIXL transfer error reading rank {r}", out)
        except Exception as e:
            logger.warning("request %s: KV read from %s failed: %s", spec.req_id, spec.remote_engine_id, e)
            return self._fail(load, f"{type(e).__name__}: {e}", out)
        if not load.handles:
            self._notify_others(load)
            out.finished_recving.append(spec.req_id)
            if load.nbytes:
                out.bytes_received += load.nbytes
                out.seconds_receiving += time.monotonic() - load.started_s
            return True
        if now > load.deadline:
            return self._fail(load, f"transfer not done within {self.config.load_timeout_s:.1f} s", out)
        return False

    # -- push loads (send_type PUT) ------------------------------------------------------------------------
    def _start_push(self, spec: KVLoad, now: float) -> None:
        """Register this rank's blocks with every producer rank it answers for (each writes its slice, or just
        frees); the load is over once each of them reported."""
        p = max(1, len(spec.remote_ports))
        nbytes = sum(sum(s.block_bytes for s in stores) for ids, rids, stores in
                     zip(spec.local_block_ids, spec.remote_block_ids, self.layout)
                     for lb, rb in zip(ids, rids) if lb >= 0 and rb >= 0)
        _, ranks, registrants = self._pairing(spec)
        req = PushRequest(self.agent_name, spec.remote_engine_id, self._metadata, self.layout, spec.req_id,
                          spec.remote_request_id, spec.local_block_ids, settings=self.settings, tp_rank=self.tp_rank,
                          tp_size=self.tp_size, registrants=registrants)
        futs = {r: self._pool.submit(register_push, spec.remote_host, self._remote_port(spec, r), req,
                                     min(5.0, self.config.load_timeout_s)) for r in ranks}
        self._push_loads[spec.req_id] = _PushLoad(spec, now + 2 * self.config.load_timeout_s, futs, nbytes)
        self._push_agents[spec.req_id] = {agent_name(spec.remote_engine_id, r, p): r for r in ranks}

    def _progress_push(self, load: _PushLoad, notes: dict[tuple[str, str], bool], now: float,
                       out: KVConnectorOutput) -> bool:
        spec = load.spec
        for name, r in self._push_agents[spec.req_id].items():
            done = notes.pop((name, spec.req_id), None)
            if done is not None:
                load.outcomes[r] = done
            elif r not in load.outcomes:
                fut = load.registered[r]
                if fut.done() and isinstance(fut.exception(), PushRefused):
                    # Refused: that rank took nothing and writes nothing.
                    logger.warning("request %s: %s", spec.req_id, fut.exception())
                    load.outcomes[r] = False
                    load.refusal = str(fut.exception())
        if len(load.outcomes) == len(load.registered):
            del self._push_agents[spec.req_id]
            if all(load.outcomes.values()):
                out.finished_recving.append(spec.req_id)
                out.bytes_received += load.nbytes
                out.seconds_receiving += now - load.started_s
            else:
                out.failed_recving[spec.req_id] = load.refusal or "the producer could not write the prompt's KV"
            return True
        if now > load.deadline:
            # No answer or no notification: the producer is gone or gave up its write (after load_timeout_s).
            logger.warning("request %s: no push from %s within %.1f s", spec.req_id, spec.remote_engine_id,
                           2 * self.config.load_timeout_s)
            del self._push_agents[spec.req_id]
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
        for peer, msgs in self.agent.get_new_notifs().items():
            name = peer.decode() if isinstance(peer, bytes) else peer
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
