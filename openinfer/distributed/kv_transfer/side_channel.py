"""The NixlConnector's side channel: one ZeroMQ request/reply exchange per pair of instances, messages as msgspec
msgpack (the NIXL agent metadata travels as opaque bytes inside; no pickle on this wire).

A reader asks a producer for its agent metadata and the layout of its KV stores (per group, per store: base
address, bytes per block, block count); it then adds the agent and computes every block's address itself. The
listener binds a free port when asked for port 0 and reports the one it got, so instances never collide.

Push (send_type PUT) reverses the roles on the same socket: the decoder sends a ``PushRequest`` - its own agent
metadata, its layout and the block ids it allocated for the producer's held request - and the producer, which
writes into them, answers at once whether it took the request; the write itself and its completion notification go
over NIXL."""
from __future__ import annotations

import logging
import threading
from typing import Callable

import msgspec
import zmq

logger = logging.getLogger(__name__)


class StoreLayout(msgspec.Struct):
    base_addr: int
    block_bytes: int
    num_blocks: int
    rows: int = 0  # > 0: split by KV heads over the tensor-parallel ranks, a block being this many rows (tp_slices.py)


class HandshakeRequest(msgspec.Struct, tag="handshake"):
    engine_id: str  # the asker's (for the producer's log)
    expect_engine_id: str  # the producer the asker was sent to: a different one answering is an error


class HandshakeReply(msgspec.Struct, tag="handshake_reply"):
    engine_id: str
    agent_metadata: bytes = b""
    groups: list[list[StoreLayout]] = []
    error: str = ""
    settings: str = ""  # what shapes the layout (model, block size, KV dtype, groups, drafter): for error messages
    tp_rank: int = 0  # the answering rank's place in its replica (its slice of split stores)
    tp_size: int = 1


class PushRequest(msgspec.Struct, tag="push"):
    engine_id: str  # the decoder's (its NIXL agent's name)
    expect_engine_id: str  # the producer the decoder was sent to
    agent_metadata: bytes  # the decoder's NIXL agent, for the producer to add
    groups: list[list[StoreLayout]]  # the decoder's stores
    req_id: str  # the decoder's request id: the completion notification names it
    remote_request_id: str  # the producer's held request
    block_ids: list[list[int]]  # the decoder's blocks per group, position for position with the held ones; -1: skip
    settings: str = ""  # the decoder's (HandshakeReply.settings)
    tp_rank: int = 0  # the decoder rank's place in its replica: which slice of split stores it wants
    tp_size: int = 1
    registrants: int = 1  # how many decoder ranks register for this prompt with this producer rank


class PushReply(msgspec.Struct, tag="push_reply"):
    engine_id: str
    error: str = ""


class ReleaseRequest(msgspec.Struct, tag="release"):
    """A decoder refused a held prompt (its params do not fit that decoder's layout): free it now, not at the
    abort timeout. Answered with a PushReply (error: not taken)."""
    engine_id: str  # the decoder's (for the producer's log)
    expect_engine_id: str
    remote_request_id: str


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(HandshakeRequest | PushRequest | ReleaseRequest)
_reply_decoder = msgspec.msgpack.Decoder(HandshakeReply)
_push_reply_decoder = msgspec.msgpack.Decoder(PushReply)


class SideChannelServer:
    """Answers handshakes on a daemon thread until ``close``. ``on_push`` (None: push is refused) takes each push
    request - and ``on_release`` each release - on that thread and returns an error text or ""; they must only hand
    the request over (a queue): the NIXL agent and the held prompts are the engine thread's."""

    def __init__(self, host: str, port: int, engine_id: str, agent_metadata: bytes,
                 groups: list[list[StoreLayout]], on_push: Callable[[PushRequest], str] | None = None,
                 settings: str = "", tp_rank: int = 0, tp_size: int = 1,
                 on_release: Callable[[ReleaseRequest], str] | None = None) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port == 0:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        self.host = host
        self._reply = HandshakeReply(engine_id, agent_metadata, groups, settings=settings, tp_rank=tp_rank,
                                     tp_size=tp_size)
        self._on_push = on_push
        self._on_release = on_release
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
            me = self._reply.engine_id
            try:
                req = _request_decoder.decode(payload)
                wrong = "" if req.expect_engine_id == me else f"this is engine {me}, not {req.expect_engine_id}"
                if isinstance(req, PushRequest):
                    if not wrong and self._on_push is None:
                        wrong = f"engine {me} is not a kv_producer: it takes no push requests"
                    reply = PushReply(me, wrong or self._on_push(req))
                elif isinstance(req, ReleaseRequest):
                    if not wrong and self._on_release is None:
                        wrong = f"engine {me} is not a kv_producer: it holds no prompts"
                    reply = PushReply(me, wrong or self._on_release(req))
                else:
                    reply = HandshakeReply(me, error=wrong) if wrong else self._reply
            except msgspec.DecodeError as e:
                reply = HandshakeReply(me, error=f"bad handshake: {e}")
            self._sock.send_multipart([ident, b"", _encoder.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        self._sock.close(0)
        self._ctx.term()


def _ask(host: str, port: int, request: msgspec.Struct, decoder: msgspec.msgpack.Decoder, timeout_s: float):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(_encoder.encode(request))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no side-channel reply from {host}:{port} within {timeout_s:.1f} s")
        return decoder.decode(sock.recv())
    finally:
        sock.close(0)


def handshake(host: str, port: int, engine_id: str, expect_engine_id: str, timeout_s: float) -> HandshakeReply:
    """Ask the producer at host:port for its agent and layout; raises TimeoutError / RuntimeError."""
    reply = _ask(host, port, HandshakeRequest(engine_id, expect_engine_id), _reply_decoder, timeout_s)
    if reply.error:
        raise RuntimeError(f"handshake with {host}:{port} refused: {reply.error}")
    return reply


class PushRefused(RuntimeError):
    """The producer answered and took nothing: it will write nothing into the blocks."""


def register_push(host: str, port: int, request: PushRequest, timeout_s: float) -> None:
    """Hand the decoder's blocks to the producer at host:port. PushRefused: it answered no. TimeoutError: no answer -
    the producer may still have the request (and write), so the caller must not reuse the blocks at once."""
    reply = _ask(host, port, request, _push_reply_decoder, timeout_s)
    if reply.error:
        raise PushRefused(f"push to {host}:{port} refused: {reply.error}")


def release_held(host: str, port: int, request: ReleaseRequest, timeout_s: float) -> None:
    """Tell the producer rank at host:port to free a held prompt now; raises on a refusal or no answer."""
    reply = _ask(host, port, request, _push_reply_decoder, timeout_s)
    if reply.error:
        raise RuntimeError(f"release at {host}:{port} refused: {reply.error}")
