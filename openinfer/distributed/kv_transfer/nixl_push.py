"""The producer's half of push (send_type PUT): NIXL-WRITE a held prompt's blocks into the blocks a decoder
registered for it, then let the NIXL completion notification tell the decoder they are full.

Why the write starts only once the prompt is done: vllm-router's PD mode (and vLLM's own proxy) sends the decoder
its request only after the prefill answer is back - the decoder cannot allocate, let alone register, blocks while
the prefill runs. So the decoder registers over the side channel when its request arrives, and the producer writes
the whole held prompt in one transfer. The producer serves only requests it holds (the block ids come from its own
scheduler, never from the message), for as many decoder ranks as register for it (one at the same
tensor_parallel_size; across sizes each takes its slice of the heads, tp_slices.py); the held blocks go back to its
pool once every registrant's write is over, however it ended. A decoder that refuses the prompt outright sends a
release instead (side_channel.ReleaseRequest): it is freed at once.

A write that errors, is refused (unknown request, another layout) or outlives ``load_timeout_s`` is reported to
the decoder with a failure notification - sent only once the transfer is confirmed over (done, errored, or
released: NIXL's release aborts an active transfer or refuses, and a refused release is retried every step), so no
byte lands in the decoder's blocks after it was told to reuse them. Runs on the engine's thread except
``on_push`` (the side channel's thread), which only queues.
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

from openinfer.config import KVTransferConfig
from openinfer.distributed.kv_transfer.side_channel import PushRequest, ReleaseRequest, StoreLayout
from openinfer.distributed.kv_transfer.tp_slices import size_mismatch, stores_fit, transfer_descs
from openinfer.step_io import KVConnectorOutput

logger = logging.getLogger(__name__)

PUSH_DONE = b"push-done\x00"  # + the decoder's request id: NIXL notification prefixes (pull's carry a bare id)
PUSH_FAIL = b"push-fail\x00"


def layout_mismatch(theirs: list[list[StoreLayout]], their_settings: str, their_tp: int,
                    mine: list[list[StoreLayout]], my_settings: str, my_tp: int, their_role: str) -> str:
    """Why two instances cannot move KV between them, naming both sides' settings ("" when they can). Either side
    may be the producer: whether the stores fit does not depend on the direction."""
    why = size_mismatch(their_tp, my_tp)
    if not why and stores_fit(theirs, their_tp, mine, my_tp):
        return ""
    if not why:
        shape = lambda g: [[(s.block_bytes, s.rows) if s.rows else s.block_bytes for s in stores]  # noqa: E731
                           for stores in g]
        why = (f"{len(theirs)} KV group(s) vs {len(mine)}" if len(theirs) != len(mine) else
               f"bytes per block per store (rows where split over tensor-parallel ranks) {shape(theirs)} at "
               f"tensor_parallel_size={their_tp} vs {shape(mine)} at tensor_parallel_size={my_tp}")
    return (f"KV layouts differ ({why}): the {their_role} runs [{their_settings or 'unknown settings'}], this "
            f"instance [{my_settings}]; start both with the same model, block_size, kv_cache_dtype and "
            f"speculative_config, and tensor_parallel_size that divide each other (and the KV heads)")


@dataclass
class _Write:
    rid: str  # the held request
    peer: str  # the decoder's agent
    notif_id: bytes  # the decoder's request id
    handle: object
    deadline: float
    nbytes: int
    started_s: float = field(default_factory=time.monotonic)
    failed: str = ""  # set once it timed out or errored: waiting for the handle to be released


class PushWriter:
    def __init__(self, agent, layout: list[list[StoreLayout]], config: KVTransferConfig, settings: str = "",
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.agent = agent
        self.layout = layout
        self.config = config
        self.settings = settings
        self.tp_rank, self.tp_size = tp_rank, tp_size  # this producer rank's slice of split stores
        self.held: dict[str, list[list[int]]] = {}  # held request id -> its blocks (from the scheduler side)
        # A held prompt several decoder ranks register for (another tensor_parallel_size, tp_slices.py): how many
        # registered so far, and its writes in flight. Its blocks go back once every registrant's write is over.
        self._taken: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}
        self._inbox: queue.SimpleQueue[PushRequest | ReleaseRequest] = queue.SimpleQueue()
        self._peers: dict[str, str] = {}  # decoder engine id -> its NIXL agent's name here
        self._writes: list[_Write] = []
        self.bytes_sent = 0
        self.seconds_sending = 0.0

    def on_push(self, req: PushRequest | ReleaseRequest) -> str:
        """Side-channel thread (a push registration or a release): queue it; the engine thread checks it against
        what it holds."""
        self._inbox.put(req)
        return ""

    def step(self, out: KVConnectorOutput) -> None:
        while True:
            try:
                req = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(req, ReleaseRequest):
                self._release(req, out)
            else:
                self._start(req, out)
        self._writes = [w for w in self._writes if not self._progress(w, out)]

    def _release(self, req: ReleaseRequest, out: KVConnectorOutput) -> None:
        """A decoder refused the held prompt: free it now - unless a decoder rank already registered for it (a write
        may read from it; that decoder's own outcome frees it)."""
        rid = req.remote_request_id
        if rid in self.held and not self._taken.get(rid) and not self._in_flight.get(rid):
            logger.info("freeing held prompt %s: decoder %s refused it", rid, req.engine_id)
            self._close(rid)
            out.finished_sending.append(rid)

    def _close(self, rid: str) -> None:
        """No more registrations for ``rid`` (all came, or one was refused: the decoder computes the prompt)."""
        self.held.pop(rid, None)
        self._taken.pop(rid, None)

    def _over(self, rid: str, out: KVConnectorOutput) -> None:
        """One write (or registration with nothing to write) for ``rid`` is over: free the prompt once it is closed
        and nothing writes from it any more."""
        n = self._in_flight.pop(rid, 0) - 1
        if n > 0:
            self._in_flight[rid] = n
        elif rid not in self.held:
            out.finished_sending.append(rid)

    def _start(self, req: PushRequest, out: KVConnectorOutput) -> None:
        try:
            peer = self._peers.get(req.engine_id)
            if peer is None:
                peer = self._peers[req.engine_id] = self.agent.add_remote_agent(req.agent_metadata)
        except Exception as e:
            logger.warning("push for %s: cannot add decoder %s's agent: %s", req.remote_request_id, req.engine_id, e)
            return  # no way to tell it; its own deadline makes it compute the prompt (nothing was written)
        rid, notif_id = req.remote_request_id, req.req_id.encode()
        held = self.held.get(rid)
        try:
            if held is None:
                raise RuntimeError(f"no held prompt {rid!r} here (expired, read, or never held)")
            why = layout_mismatch(req.groups, req.settings, req.tp_size, self.layout, self.settings, self.tp_size,
                                  "decoder")
            if why:
                raise RuntimeError(why)
            local_d, remote_d = transfer_descs(held, req.block_ids, self.layout, self.tp_rank, self.tp_size,
                                               req.groups, req.tp_rank, req.tp_size)
            handle = None
            if local_d:
                handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local_d, "DRAM"),
                                                    self.agent.get_xfer_descs(remote_d, "DRAM"), peer,
                                                    PUSH_DONE + notif_id)
        except Exception as e:
            logger.warning("push for %s refused: %s", rid, e)
            self._notify(peer, PUSH_FAIL + notif_id)
            if held is not None:  # the decoder computes it: free ours once no other registrant's write reads it
                self._close(rid)
                self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
                self._over(rid, out)
            return
        self._taken[rid] = self._taken.get(rid, 0) + 1
        if self._taken[rid] >= req.registrants:
            self._close(rid)
        self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
        if handle is None:  # nothing of this prompt is this decoder rank's (or every position was local there)
            self.agent.send_notif(peer, PUSH_DONE + notif_id)
            self._over(rid, out)
            return
        w = _Write(rid, peer, notif_id, handle, time.monotonic() + self.config.load_timeout_s,
                   sum(n for _, n, _ in local_d))
        out.sending_started.append(w.rid)  # the scheduler side must not expire (free) its blocks meanwhile
        try:
            if self.agent.transfer(handle) == "ERR":
                w.failed = "NIXL write error at post"
        except Exception as e:
            w.failed = f"{type(e).__name__}: {e}"
        self._writes.append(w)

    def _progress(self, w: _Write, out: KVConnectorOutput) -> bool:
        """True when the write is over and its handle released."""
        if not w.failed:
            state = self.agent.check_xfer_state(w.handle)
            if state == "DONE":
                self.agent.release_xfer_handle(w.handle)
                self.bytes_sent += w.nbytes
                self.seconds_sending += time.monotonic() - w.started_s
                self._over(w.rid, out)
                return True
            if state == "PROC" and time.monotonic() <= w.deadline:
                return False
            w.failed = "NIXL write error" if state == "ERR" else \
                f"write not done within {self.config.load_timeout_s:.1f} s"
        try:  # aborts it if still active; raises if NIXL cannot: then it may still write, and we try again later
            self.agent.release_xfer_handle(w.handle)
        except Exception:
            logger.debug("push for %s: transfer not released yet (%s)", w.rid, w.failed, exc_info=True)
            return False
        logger.warning("push for %s failed: %s", w.rid, w.failed)
        self._notify(w.peer, PUSH_FAIL + w.notif_id)
        self._over(w.rid, out)
        return True

    def _notify(self, peer: str, msg: bytes) -> None:
        try:
            self.agent.send_notif(peer, msg)
        except Exception:
            logger.debug("could not notify decoder agent %s", peer, exc_info=True)
