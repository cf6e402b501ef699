"""The engine core in its own thread, and the asyncio side that talks to it.

``LLMEngine`` is not thread-safe, so exactly one thread (the core thread) touches it. The event loop sends it
typed commands through a queue and never blocks on it; the core thread answers with ``RequestUpdate`` diffs,
delivered in one ``loop.call_soon_threadsafe`` per loop iteration into per-request ``asyncio.Queue``\\ s.
Admission is bounded: at most ``max_num_seqs + max_queue`` sequences are in flight; beyond that ``submit``
refuses at once (the HTTP layer answers 429) instead of queueing without limit.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable

import msgspec

from openinfer.engine.llm_engine import LLMEngine
from openinfer.kv_events import KVEventBatch
from openinfer.sampling_params import RequestOutputKind
from openinfer.server.messages import (
    AbortRequests,
    AddRequest,
    Control,
    ControlReply,
    EngineCommand,
    EngineDead,
    EngineEvent,
    RequestUpdate,
    Shutdown,
    KVOffloadSnapshot,
    StatsSnapshot,
)
from openinfer.server.metrics import ServerMetrics
from openinfer.server.output_tracker import OutputTracker

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # how long the idle core thread sleeps on its inbox: bounds heartbeat age when idle


class EngineOverloaded(Exception):
    """The bounded queue is full; retry later (HTTP 429)."""


class EngineUnavailable(Exception):
    """Draining for shutdown, or the core thread died (HTTP 503)."""


class RequestStream:
    """The loop-side end of one HTTP request's engine requests (several when a completion has several
    prompts). Iterate ``get()`` until ``done``; ``abort()`` (idempotent) cancels whatever has not finished."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str]) -> None:
        self.engine = engine
        self.request_ids = request_ids
        self.queue: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        self.pending = set(request_ids)
        self.started_s = time.monotonic()
        self.timed_out = False  # set by expire(): its abort ends it as a timeout (HTTP 504), not a plain abort
        self.timeout_reason = ""

    @property
    def done(self) -> bool:
        return not self.pending

    async def get(self) -> RequestUpdate:
        update = await self.queue.get()
        if update.finished:
            self.pending.discard(update.request_id)
        return update

    async def get_batch(self) -> list[RequestUpdate]:
        """Everything queued now (at least one update). A consumer that fell behind catches up in one
        write instead of one socket send per engine step."""
        batch = [await self.queue.get()]
        while not self.queue.empty():
            batch.append(self.queue.get_nowait())
        for u in batch:
            if u.finished:
                self.pending.discard(u.request_id)
        return batch

    def abort(self) -> None:
        if self.pending:
            self.engine.abort(list(self.pending))


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.capacity = engine.config.scheduler.max_num_seqs + max_queue
        self._inbox: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # loop side: request id -> its stream
        self._seqs: dict[str, int] = {}  # loop side: request id -> sequences it holds (n)
        self.num_in_flight = 0  # sequences admitted and not yet finished (loop side)
        self._controls: dict[int, asyncio.Future] = {}
        self._control_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.stats = StatsSnapshot(heartbeat_s=time.monotonic())
        self.draining = False
        self.dead_reason: str | None = None
        # Called on the loop once the core has died and every open request has been ended (the server exits).
        self.on_dead: Callable[[str], None] | None = None
        self._tracker = OutputTracker(metrics)
        # Set to receive the KV cache events each core-loop iteration recorded (kv_events_publisher.py); called on
        # the core thread, so it must only enqueue.
        self.kv_event_sink: Callable[[KVEventBatch], None] | None = None

    # -- lifecycle (loop side) -------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._publish_stats(None)
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    async def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is None:
            return
        self._inbox.put(Shutdown())
        if self.dead_reason is not None:
            timeout_s = min(timeout_s, 1.0)  # a wedged core never reads its inbox: don't wait for it
        await asyncio.to_thread(self._thread.join, timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    # -- requests (loop side) --------------------------------------------------------------------
    def submit(self, requests: list[AddRequest]) -> RequestStream:
        """Admit all of ``requests`` or none of them."""
        if self.dead_reason is not None or not self.alive:
            raise EngineUnavailable(f"the engine is not running ({self.dead_reason or 'stopped'})")
        if self.draining:
            raise EngineUnavailable("the server is shutting down and accepts no new requests")
        seqs = sum(r.params.n for r in requests)
        if self.num_in_flight + seqs > self.capacity:
            raise EngineOverloaded(
                f"the server's queue is full ({self.num_in_flight} sequences in flight, "
                f"limit {self.capacity} = max_num_seqs + max_queue); retry later"
            )
        stream = RequestStream(self, [r.request_id for r in requests])
        for r in requests:
            self._streams[r.request_id] = stream
            self._seqs[r.request_id] = r.params.n
            self.num_in_flight += r.params.n
            self._inbox.put(r)
        return stream

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = [i for i in request_ids if i in self._streams]
        if ids:
            self._inbox.put(AbortRequests(ids))

    def abort_all(self) -> None:
        self.abort(list(self._streams))

    async def control(self, op: str, timeout_s: float = 30.0) -> int | str | None:
        if not self.alive:
            raise EngineUnavailable(f"the engine is not running ({self.dead_reason or 'stopped'})")
        cid = next(self._control_ids)
        fut = asyncio.get_running_loop().create_future()
        self._controls[cid] = fut
        self._inbox.put(Control(cid, op))
        try:
            reply: ControlReply = await asyncio.wait_for(fut, timeout_s)
        finally:
            self._controls.pop(cid, None)
        if not reply.ok:
            if self.dead_reason is not None:
                raise EngineUnavailable(self.dead_reason)
            raise RuntimeError(str(reply.value))
        return reply.value

    def _deliver(self, events: list[EngineEvent]) -> None:
        """Runs on the loop: route each event to its stream (one call per core-loop iteration)."""
        for ev in events:
            if isinstance(ev, EngineDead):
                self._fail_all(ev.reason)
                continue
            if isinstance(ev, ControlReply):
                fut = self._controls.get(ev.control_id)
                if fut is not None and not fut.done():
                    fut.set_result(ev)
                continue
            stream = self._streams.get(ev.request_id)
            if ev.finished:
                self._streams.pop(ev.request_id, None)
                self.num_in_flight -= self._seqs.pop(ev.request_id, 0)
            if stream is not None:
                if ev.finished and stream.timed_out and not ev.error and _ended_by_abort(ev):
                    ev = msgspec.structs.replace(ev, error=stream.timeout_reason, error_kind="timeout")
                stream.queue.put_nowait(ev)

    # -- health (loop side, driven by server/health.py's watchdog) -------------------------------------
    def expire(self, now: float, timeout_s: float) -> int:
        """Abort every request running longer than ``timeout_s``; its final update then carries a timeout
        error, and the core frees its blocks as for any abort. Returns how many requests were aborted."""
        late = [s for s in set(self._streams.values()) if not s.timed_out and now - s.started_s > timeout_s]
        for stream in late:
            stream.timed_out = True
            stream.timeout_reason = (f"the request ran longer than the server's request timeout of {timeout_s:g}s "
                                     "and was aborted")
            stream.abort()
        return len(late)

    def wedged(self, reason: str) -> None:
        """The core thread is stuck in a step: end every open request now, from the loop side (the core cannot),
        and die (``on_dead`` exits the process). The aborts are queued too, so that should the step ever return
        before the process is gone, the core frees their KV blocks; the blocks cannot be touched from here while
        the core thread may be inside the scheduler."""
        if self.dead_reason is not None:
            return
        if self._streams:
            self._inbox.put(AbortRequests(list(self._streams)))
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        """Loop side: the core is gone. End every open request (including ones whose AddRequest the core never
        read) so no handler waits forever; ``submit`` refuses from now on."""
        self.dead_reason = reason
        for rid, stream in list(self._streams.items()):
            stream.queue.put_nowait(RequestUpdate(rid, finished=True, error=reason, error_kind="engine"))
        if self.on_dead is not None:
            self.on_dead(reason)
        self._streams.clear()
        self._seqs.clear()
        self.num_in_flight = 0
        for cid, fut in list(self._controls.items()):
            if not fut.done():
                fut.set_result(ControlReply(cid, False, reason))

    # -- core thread -----------------------------------------------------------------------------
    def _send(self, events: list[EngineEvent]) -> None:
        if not events:
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver, events)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is listening
            pass

    def _publish_stats(self, step_started_s: float | None) -> None:
        s = self.engine.stats()
        self.stats = StatsSnapshot(
            s.num_running,
            s.num_waiting,
            s.kv_cache_usage,
            s.num_free_blocks,
            s.num_blocks,
            s.prefix_cache_queries,
            s.prefix_cache_hits,
            s.num_preemptions,
            self.stats.num_steps + (step_started_s is not None),
            time.monotonic(),
            step_started_s,
            s.eplb_rebalances,
            s.eplb_imbalance_served,
            s.eplb_imbalance_rebalanced,
            s.spec_decode.num_drafts,
            s.spec_decode.num_draft_tokens,
            s.spec_decode.num_accepted_tokens,
            list(s.spec_decode.accepted_per_pos),
            *_transfer_fields(s),
            consecutive_failed_steps=s.consecutive_failed_steps,
            rank_loads=list(s.rank_loads),
            kv_offload=KVOffloadSnapshot(**vars(s.kv_offload)) if s.kv_offload is not None else None,
        )

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                events: list[EngineEvent] = []
                stop = self._handle_commands(events, block=not engine.has_unfinished_requests())
                if stop:
                    self._send(events)
                    return
                if engine.has_unfinished_requests():
                    t0 = time.monotonic()
                    self.stats = msgspec.structs.replace(self.stats, step_started_s=t0)
                    outputs = engine.step()
                    now = time.monotonic()
                    for out in outputs:
                        u = self._tracker.update(out, now)
                        if u is not None:
                            events.append(u)
                    self._publish_stats(t0)
                else:
                    self._publish_stats(None)
                self._send(events)
                if self.kv_event_sink is not None:
                    for batch in engine.take_kv_events():
                        self.kv_event_sink(batch)
        except BaseException as e:  # a bug in the core: fail every request loudly rather than hang them
            logger.exception("engine core thread died")
            reason = f"engine core failed: {type(e).__name__}: {e}"
            self.dead_reason = reason
            self._send([EngineDead(reason)])

    def _handle_commands(self, events: list[EngineEvent], block: bool) -> bool:
        cmds = []
        try:
            cmds.append(self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait())
            while True:
                cmds.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        now = time.monotonic()
        for cmd in cmds:
            if isinstance(cmd, AddRequest):
                self._add(cmd, events)
            elif isinstance(cmd, AbortRequests):
                for out in self.engine.abort_request(cmd.request_ids):
                    u = self._tracker.update(out, now)
                    if u is not None:
                        events.append(u)
            elif isinstance(cmd, Control):
                events.append(self._control(cmd))
            elif isinstance(cmd, Shutdown):
                for out in self.engine.abort_request(list(self._tracker.active)):
                    u = self._tracker.update(out, now)
                    if u is not None:
                        events.append(u)
                return True
        return False

    def _add(self, cmd: AddRequest, events: list[EngineEvent]) -> None:
        prompt = {"prompt": cmd.prompt, "prompt_token_ids": cmd.prompt_token_ids}
        if cmd.mm_images:
            prompt["mm_images"] = cmd.mm_images
        arrival_s = time.monotonic() if cmd.arrival_s is None else cmd.arrival_s
        # Streams want what is new each step: the engine sends deltas, nobody re-derives them.
        params = cmd.params.clone(output_kind=RequestOutputKind.DELTA)
        try:
            self.engine.add_request(cmd.request_id, prompt, params, arrival_s=arrival_s, priority=cmd.priority)
        except ValueError as e:
            events.append(RequestUpdate(cmd.request_id, finished=True, error=str(e), error_kind="invalid"))
            return
        self._tracker.add(cmd.request_id, len(cmd.prompt_token_ids), arrival_s)
        events.append(
            RequestUpdate(cmd.request_id, accepted=True, num_prompt_tokens=len(cmd.prompt_token_ids))
        )

    def _control(self, cmd: Control) -> ControlReply:
        try:
            if cmd.op == "reset_prefix_cache":
                return ControlReply(cmd.control_id, True, int(self.engine.reset_prefix_cache()))
            return ControlReply(cmd.control_id, False, f"unknown control op {cmd.op!r}")
        except Exception as e:  # report, don't kill the core
            logger.exception("control %s failed", cmd.op)
            return ControlReply(cmd.control_id, False, f"{type(e).__name__}: {e}")


def _ended_by_abort(u: RequestUpdate) -> bool:
    """The final update of a request its abort ended (not one that finished on its own meanwhile)."""
    return all(d.finish_reason in (None, "abort") for d in u.outputs)


def _transfer_fields(s) -> tuple:
    """StatsSnapshot's prompt-source and KV-transfer fields, in its order, from the engine's stats."""
    t = s.kv_transfer
    kv = (t.loads_ok, t.load_failures, t.fallbacks, t.bytes_received, t.seconds_receiving, t.sends_ok,
          t.sends_expired) if t is not None else (0, 0, 0, 0, 0.0, 0, 0)
    return (s.prompt_tokens_computed, s.prompt_tokens_cached, s.prompt_tokens_received, s.generation_tokens,
            *kv, s.num_held_for_transfer)
