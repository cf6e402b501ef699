"""Publishes the engine's KV cache events over ZeroMQ, the way vLLM does, so KV-aware routers subscribe to
openinfer unchanged.

Each batch goes out as a three-frame message ``(topic, seq, payload)``: the topic bytes, the sequence number as
8 big-endian bytes, and the batch as msgpack (msgspec; openinfer/kv_events.py has the schema). The last
``buffer_steps`` payloads stay in memory; a client that missed some sends ``(b"", start_seq)`` to the replay
ROUTER socket and gets ``(b"", seq, payload)`` for each buffered batch from there on, then ``(b"", -1, b"")``.

vLLM's publisher is not importable without vLLM, so this is our own, on pyzmq: the core thread only enqueues
(never blocks on a socket); one publisher thread owns both sockets (ZeroMQ sockets are not thread-safe).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import zmq

from openinfer.engine.llm_engine import LLMEngine
from openinfer.kv_events import KVEventBatch, KVEventsConfig, encode_batch
from openinfer.server.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local-transport address, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._seq = 0
        self.num_dropped = 0  # batches refused because the queue was full (the publisher thread fell behind)
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv-events-config: cannot open {config.endpoint!r} / {config.replay_endpoint!r}: {e}") \
                from None
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        logger.info("publishing KV cache events on %s (topic %r)", config.endpoint, config.topic)

    # -- any thread ----------------------------------------------------------------------------------------
    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:  # never stall the engine for observers; subscribers see the gap in seq numbers
            self.num_dropped += 1

    def shutdown(self, timeout_s: float = 2.0) -> None:
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    # -- publisher thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encode_batch(batch)
            seq = self._seq
            self._seq += 1
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
            except zmq.ZMQError:
                logger.exception("KV event batch %d not sent", seq)
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def start_kv_events(engine: LLMEngine, async_engine: AsyncEngine,
                    config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    """Per ``--kv-events-config``: make the engine record events and feed them to a publisher (None when off)."""
    if config is None or not config.active:
        return None
    engine.enable_kv_events()  # before the core thread starts: from then on only that thread touches the engine
    publisher = ZmqEventPublisher(config)
    async_engine.kv_event_sink = publisher.publish
    return publisher
