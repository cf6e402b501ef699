"""The NixlConnector's side channel: one ZeroMQ request/reply exchange per pair of instances, messages as msgspec
msgpack (the NIXL agent metadata travels as opaque bytes inside; no pickle on this wire).

A reader asks a producer for its agent metadata and the layout of its KV stores (per group, per store: base
address, bytes per block, block count); it then adds the agent and computes every block's address itself. The
listener binds a free port when asked for port 0 and reports the one it got, so instances never collide."""
from __future__ import annotations

import logging
import threading

import msgspec
import zmq

logger = logging.getLogger(__name__)


class StoreLayout(msgspec.Struct):
    base_addr: int
    block_bytes: int
    num_blocks: int


class HandshakeRequest(msgspec.Struct, tag="handshake"):
    engine_id: str  # the asker's (for the producer's log)
    expect_engine_id: str  # the producer the asker was sent to: a different one answering is an error


class HandshakeReply(msgspec.Struct, tag="handshake_reply"):
    engine_id: str
    agent_metadata: bytes = b""
    groups: list[list[StoreLayout]] = []
    error: str = ""


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(HandshakeRequest)
_reply_decoder = msgspec.msgpack.Decoder(HandshakeReply)


class SideChannelServer:
    """Answers handshakes on a daemon thread until ``close``."""

    def __init__(self, host: str, port: int, engine_id: str, agent_metadata: bytes,
                 groups: list[list[StoreLayout]]) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port == 0:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        self.host = host
        self._reply = HandshakeReply(engine_id, agent_metadata, groups)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
            ident, payload = frames[0], frames[-1]
            try:
                req = _request_decoder.decode(payload)
                reply = self._reply
                if req.expect_engine_id != self._reply.engine_id:
                    reply = HandshakeReply(self._reply.engine_id,
                                           error=f"this is engine {self._reply.engine_id}, not {req.expect_engine_id}")
            except msgspec.DecodeError as e:
                reply = HandshakeReply(self._reply.engine_id, error=f"bad handshake: {e}")
            self._sock.send_multipart([ident, b"", _encoder.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        self._sock.close(0)
        self._ctx.term()


def handshake(host: str, port: int, engine_id: str, expect_engine_id: str, timeout_s: float) -> HandshakeReply:
    """Ask the producer at host:port for its agent and layout; raises TimeoutError / RuntimeError."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(_encoder.encode(HandshakeRequest(engine_id, expect_engine_id)))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no handshake reply from {host}:{port} within {timeout_s:.1f} s")
        reply = _reply_decoder.decode(sock.recv())
    finally:
        sock.close(0)
    if reply.error:
        raise RuntimeError(f"handshake with {host}:{port} refused: {reply.error}")
    return reply
