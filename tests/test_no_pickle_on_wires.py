"""No pickle on any wire (issue 12, must-show 5). Every byte openinfer sends or receives over ZeroMQ is captured
while a real path runs, and so are HTTP bodies; none may be a pickle stream. A source scan backs it up: no module
imports pickle / cloudpickle / dill, and no call uses an API that pickles under the hood (pyzmq's ``*_pyobj``,
torch.distributed's ``*_object*``).

A new socket joins by adding one driver to ``WIRES``: a function that exercises the path (the capture is already
in place around every ``zmq.Socket`` of the test process, so the engine's side of each socket is seen, which
includes every frame the other side sends).
"""

from __future__ import annotations

import ast
import pickle
import pickletools
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from server_utils import InProcessServer, shared_checkpoint

ROOT = Path(__file__).resolve().parent.parent / "openinfer"


def is_pickle(data: bytes) -> bool:
    """A pickle stream: the protocol 2-5 header, or bytes that parse as one whole pickle (protocol 0/1 have no
    header; ``pickletools.genops`` then reads them opcode by opcode up to a STOP that must be the last byte)."""
    if len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5:
        return True
    try:
        end = None
        for _, _, pos in pickletools.genops(data):
            end = pos
        return end == len(data) - 1
    except Exception:
        return False


class Capture:
    """Every frame sent or received by any zmq.Socket of this process while active."""

    def __init__(self, monkeypatch) -> None:
        self.frames: list[tuple[str, bytes]] = []
        sock = zmq.Socket
        orig_send, orig_recv = sock.send, sock.recv
        orig_send_multipart, orig_recv_multipart = sock.send_multipart, sock.recv_multipart
        cap = self

        def keep(kind: str, data) -> None:
            if isinstance(data, zmq.Frame):
                data = data.bytes
            cap.frames.append((kind, bytes(data)))

        def send(self, data, *a, **kw):
            keep("send", data)
            return orig_send(self, data, *a, **kw)

        def recv(self, *a, **kw):
            out = orig_recv(self, *a, **kw)
            keep("recv", out)
            return out

        def send_multipart(self, parts, *a, **kw):
            for p in parts:
                keep("send", p)
            return orig_send_multipart(self, parts, *a, **kw)

        def recv_multipart(self, *a, **kw):
            out = orig_recv_multipart(self, *a, **kw)
            for p in out:
                keep("recv", p)
            return out

        # send_multipart calls send for every frame, so a frame is seen once or twice: either way it is checked.
        monkeypatch.setattr(sock, "send", send)
        monkeypatch.setattr(sock, "recv", recv)
        monkeypatch.setattr(sock, "send_multipart", send_multipart)
        monkeypatch.setattr(sock, "recv_multipart", recv_multipart)


def _executor_wire(ckpt: Path) -> None:
    """The multiprocess executor's ROUTER socket: step messages to a worker process and its replies."""
    from openinfer.entrypoints.llm import LLM
    from openinfer.sampling_params import SamplingParams

    llm = LLM(str(ckpt), dtype="float32", distributed_executor_backend="mp", max_model_len=256, num_kv_blocks=64)
    try:
        out = llm.generate([[5, 6, 7, 8] * 5], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.engine.shutdown()


def _kv_events_wire(ckpt: Path) -> None:
    """KV cache events: PUB batches and the replay ROUTER, from a real engine's block pool."""
    from openinfer.entrypoints.llm import LLM
    from openinfer.kv_events import KVEventsConfig, decode_batch
    from openinfer.sampling_params import SamplingParams
    from openinfer.server.kv_events_publisher import ZmqEventPublisher

    ctx = zmq.Context()
    endpoint = f"inproc://kv-events-{time.monotonic_ns()}"
    replay = f"inproc://kv-replay-{time.monotonic_ns()}"
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                                           replay_endpoint=replay, topic="kv"), context=ctx)
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.2)
    llm = LLM(str(ckpt), dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=16)
    try:
        llm.engine.enable_kv_events()
        llm.generate([list(range(3, 60))], SamplingParams(max_tokens=2, temperature=0.0))
        llm.engine.reset_prefix_cache()
        batches = llm.engine.take_kv_events()
        assert batches
        for b in batches:
            pub.publish(b)
        assert sub.poll(5000)
        assert decode_batch(sub.recv_multipart()[2]).events
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        while dealer.poll(5000) and dealer.recv_multipart()[1] != (-1).to_bytes(8, "big", signed=True):
            pass
        dealer.close(0)
    finally:
        llm.engine.shutdown()
        pub.shutdown()
        sub.close(0)
        ctx.term()


def _kv_transfer_side_channel(ckpt: Path) -> None:
    """The KV connector's side channel: the NIXL handshake (agent metadata as opaque bytes, the KV layout), both
    the accepted and the refused (wrong engine id) exchange, and push mode's registration of the decoder's blocks
    (accepted and refused). The pull block ids travel in kv_transfer_params over HTTP (checked by the HTTP test) and
    a transfer's completion as a NIXL notification carrying the request id."""
    from openinfer.distributed.kv_transfer.side_channel import (
        PushRefused,
        PushRequest,
        SideChannelServer,
        StoreLayout,
        handshake,
        register_push,
    )

    pushes: list[PushRequest] = []
    server = SideChannelServer("127.0.0.1", 0, "prod", b"\x80\x04agent-bytes", [[StoreLayout(4096, 64, 8)]],
                               on_push=lambda r: pushes.append(r) or ("" if r.remote_request_id == "held" else "no"))
    try:
        reply = handshake("127.0.0.1", server.port, "me", "prod", 5.0)
        assert reply.agent_metadata == b"\x80\x04agent-bytes"  # opaque bytes inside msgpack, not a frame of their own
        with pytest.raises(RuntimeError):
            handshake("127.0.0.1", server.port, "me", "other", 5.0)
        push = PushRequest("me", "prod", b"\x80\x04dec-agent", [[StoreLayout(8192, 64, 8)]], "r1", "held", [[3, -1]])
        register_push("127.0.0.1", server.port, push, 5.0)
        with pytest.raises(PushRefused):
            register_push("127.0.0.1", server.port, msgspec.structs.replace(push, remote_request_id="gone"), 5.0)
        assert [p.block_ids for p in pushes] == [[[3, -1]], [[3, -1]]]
    finally:
        server.close()


WIRES: dict[str, Callable[[Path], None]] = {
    "executor-step-messages": _executor_wire,
    "kv-events": _kv_events_wire,
    "kv-transfer-side-channel": _kv_transfer_side_channel,
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return shared_checkpoint(tmp_path_factory)


def test_the_detector_finds_pickles_and_passes_msgpack_and_json():
    import msgspec

    obj = {"request_id": "r1", "token_ids": [1, 2, 3], "x": 1.5}
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        assert is_pickle(pickle.dumps(obj, protocol=proto)), proto
    assert is_pickle(pickle.dumps(None, protocol=0))
    assert not is_pickle(msgspec.msgpack.encode(obj))
    assert not is_pickle(msgspec.json.encode(obj))
    assert not is_pickle(b"") and not is_pickle(b"data: [DONE]\n\n")


@pytest.mark.parametrize("wire", [pytest.param(w, marks=pytest.mark.slow) if w == "executor-step-messages" else w
                                  for w in sorted(WIRES)])  # the executor wire starts worker processes
def test_no_pickle_on_zmq(wire, ckpt, monkeypatch):
    cap = Capture(monkeypatch)
    WIRES[wire](ckpt)
    assert len(cap.frames) >= 4, f"{wire}: nothing was captured, so nothing was checked"
    assert {k for k, _ in cap.frames} == {"send", "recv"}
    bad = [(k, f[:40]) for k, f in cap.frames if is_pickle(f)]
    assert not bad, f"{wire}: pickle on the wire: {bad}"


def test_no_pickle_in_http_bodies(ckpt):
    with InProcessServer(ckpt, dtype="float32", max_model_len=256, num_kv_blocks=64) as s:
        bodies: list[bytes] = []
        calls = [
            ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi there", "max_tokens": 3}),
            ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi there", "max_tokens": 3, "stream": True}),
            ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2}),
            ("POST", "/tokenize", {"prompt": "hi"}),
            ("POST", "/v1/completions", {"model": "nope", "prompt": "x"}),  # an error body too
            ("GET", "/v1/models", None), ("GET", "/get_load", None), ("GET", "/get_server_info", None),
            ("GET", "/metrics", None), ("GET", "/health", None),
        ]
        with httpx.Client(base_url=s.url, timeout=60) as client:
            for method, path, body in calls:
                req = client.build_request(method, path, json=body)
                bodies.append(req.content)
                r = client.send(req)
                bodies.append(r.content)
                bodies += [line.encode() for line in r.text.splitlines() if line]  # each SSE event on its own
        assert len(bodies) > 20
        assert not [b[:40] for b in bodies if b and is_pickle(b)]


BANNED_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib"}
# APIs that pickle under the hood: pyzmq's object helpers and torch.distributed's object collectives.
BANNED_CALLS = {"send_pyobj", "recv_pyobj", "all_gather_object", "gather_object", "scatter_object_list",
                "broadcast_object_list", "send_object_list", "recv_object_list"}


def test_no_pickle_in_the_source():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n.split(".")[0] in BANNED_MODULES for n in names):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {names}")
            if isinstance(node, ast.Attribute) and node.attr in BANNED_CALLS:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "load" and \
                    getattr(node.func.value, "id", None) == "torch":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.load unpickles")
    assert not bad, "\n".join(bad)
