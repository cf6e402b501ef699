"""The producer's half of push (send_type PUT): NIXL-WRITE a held prompt's blocks into the blocks a decoder
registered for it, then let the NIXL completion notification tell the decoder they are full.

Why the write starts only once the prompt is done: vllm-router's PD mode (and vLLM's own proxy) sends the decoder
its request only after the prefill answer is back - the decoder cannot allocate, let alone register, blocks while
the prefill runs. So the decoder registers over the side channel when its request arrives, and the producer writes
the whole held prompt in one transfer. The producer serves only requests it holds (the block ids come from its own
scheduler, never from the message), at most once each; the held blocks go back to its pool when the write is
over, however it ended.

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
from openinfer.distributed.kv_transfer.side_channel import PushRequest, StoreLayout
from openinfer.step_io import KVConnectorOutput

logger = logging.getLogger(__name__)

PUSH_DONE = b"push-done\x00"  # + the decoder's request id: NIXL notification prefixes (pull's carry a bare id)
PUSH_FAIL = b"push-fail\x00"


def layouts_match(a: list[list[StoreLayout]], b: list[list[StoreLayout]]) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(s.block_bytes == t.block_bytes for s, t in zip(x, y))
                                    for x, y in zip(a, b))


def layout_mismatch(theirs: list[list[StoreLayout]], their_settings: str, mine: list[list[StoreLayout]],
                    my_settings: str, their_role: str) -> str:
    """Why two instances cannot move KV between them, naming both sides' settings ("" when they can)."""
    if layouts_match(theirs, mine):
        return ""
    shape = lambda g: [[s.block_bytes for s in stores] for stores in g]  # noqa: E731
    diff = (f"{len(theirs)} KV group(s) vs {len(mine)}" if len(theirs) != len(mine) else
            f"bytes per block per store {shape(theirs)} vs {shape(mine)}")
    return (f"KV layouts differ ({diff}): the {their_role} runs [{their_settings or 'unknown settings'}], this "
            f"instance [{my_settings}]; start both with the same model, block_size, kv_cache_dtype, "
            f"speculative_config and tensor_parallel_size")


def block_descs(src_ids: list[list[int]], dst_ids: list[list[int]], src: list[list[StoreLayout]],
                dst: list[list[StoreLayout]]) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(address, bytes, device) of every (group, store, block) that both sides name (-1 on either side: skipped)."""
    src_d, dst_d = [], []
    for s_ids, d_ids, s_stores, d_stores in zip(src_ids, dst_ids, src, dst):
        if len(s_ids) != len(d_ids):
            raise RuntimeError(f"block lists differ in length ({len(s_ids)} vs {len(d_ids)})")
        for a, b in zip(s_ids, d_ids):
            if a < 0 or b < 0:
                continue
            for s, d in zip(s_stores, d_stores):
                if a >= s.num_blocks or b >= d.num_blocks:
                    raise RuntimeError(f"block id out of range ({a}, {b})")
                src_d.append((s.base_addr + a * s.block_bytes, s.block_bytes, 0))
                dst_d.append((d.base_addr + b * d.block_bytes, d.block_bytes, 0))
    return src_d, dst_d


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
    def __init__(self, agent, layout: list[list[StoreLayout]], config: KVTransferConfig, settings: str = "") -> None:
        self.agent = agent
        self.layout = layout
        self.config = config
        self.settings = settings
        self.held: dict[str, list[list[int]]] = {}  # held request id -> its blocks (from the scheduler side)
        self._inbox: queue.SimpleQueue[PushRequest] = queue.SimpleQueue()
        self._peers: dict[str, str] = {}  # decoder engine id -> its NIXL agent's name here
        self._writes: list[_Write] = []
        self.bytes_sent = 0
        self.seconds_sending = 0.0

    def on_push(self, req: PushRequest) -> str:
        """Side-channel thread: queue it; the engine thread checks it against what it holds."""
        self._inbox.put(req)
        return ""

    def step(self, out: KVConnectorOutput) -> None:
        while True:
            try:
                req = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._start(req, out)
        self._writes = [w for w in self._writes if not self._progress(w, out)]

    def _start(self, req: PushRequest, out: KVConnectorOutput) -> None:
        try:
            peer = self._peers.get(req.engine_id)
            if peer is None:
                peer = self._peers[req.engine_id] = self.agent.add_remote_agent(req.agent_metadata)
        except Exception as e:
            logger.warning("push for %s: cannot add decoder %s's agent: %s", req.remote_request_id, req.engine_id, e)
            return  # no way to tell it; its own deadline makes it compute the prompt (nothing was written)
        notif_id = req.req_id.encode()
        held = self.held.pop(req.remote_request_id, None)
        try:
            if held is None:
                raise RuntimeError(f"no held prompt {req.remote_request_id!r} here (expired, read, or never held)")
            why = layout_mismatch(req.groups, req.settings, self.layout, self.settings, "decoder")
            if why:
                raise RuntimeError(why)
            local_d, remote_d = block_descs(held, req.block_ids, self.layout, req.groups)
            if not local_d:
                self.agent.send_notif(peer, PUSH_DONE + notif_id)
                out.finished_sending.append(req.remote_request_id)
                return
            handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local_d, "DRAM"),
                                                self.agent.get_xfer_descs(remote_d, "DRAM"), peer,
                                                PUSH_DONE + notif_id)
        except Exception as e:
            logger.warning("push for %s refused: %s", req.remote_request_id, e)
            self._notify(peer, PUSH_FAIL + notif_id)
            if held is not None:
                out.finished_sending.append(req.remote_request_id)  # the decoder computes it; free ours
            return
        w = _Write(req.remote_request_id, peer, notif_id, handle, time.monotonic() + self.config.load_timeout_s,
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
                out.finished_sending.append(w.rid)
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
        out.finished_sending.append(w.rid)
        return True

    def _notify(self, peer: str, msg: bytes) -> None:
        try:
            self.agent.send_notif(peer, msg)
        except Exception:
            logger.debug("could not notify decoder agent %s", peer, exc_info=True)
