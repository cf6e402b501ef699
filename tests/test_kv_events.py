"""KV cache events in vLLM's format: the block pool records them, the server publishes them over ZeroMQ, a SUB
client decodes them with msgspec (a positional batch of tagged maps, as vllm-router reads them)."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest
import zmq
from server_utils import InProcessServer, free_port, shared_checkpoint

from openinfer.engine.block_pool import ROOT_HASH, BlockPool, chain_key
from openinfer.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    decode_batch,
    encode_batch,
    external_hash,
)

BS = 16


def test_block_pool_records_stored_removed_cleared():
    pool = BlockPool(3, enable_caching=True)
    a = pool.allocate(2)
    k1 = chain_key(ROOT_HASH, (1, 2))
    pool.cache_block(a[0], k1)
    assert pool.take_events() == []  # not recording yet
    pool.record_events()
    k2 = chain_key(hash(k1), (3, 4))
    pool.cache_block(a[1], k2)
    pool.cache_block(pool.allocate(1)[0], k2)  # an identical block stays private: no second event
    pool.release(a[::-1])
    pool.allocate(1)  # evicts a[1] (freed first, LRU front), which holds k2
    pool.reset_prefix_cache()
    events = pool.take_events()
    assert events == [
        BlockStored([external_hash(hash(k2))], external_hash(hash(k1)), [3, 4], 2, None, "GPU", None),
        BlockRemoved([external_hash(hash(k2))], "GPU"),
        AllBlocksCleared(),
    ]
    assert pool.take_events() == []
    # vLLM's wire layout: the batch a positional array, each event a map tagged with its class name (vllm-router
    # 0.1.17 refuses an event sent as an array, and every kv_aware lookup then misses: test_router_launcher.py).
    raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(1.5, events, 0)))
    assert raw[0] == 1.5 and raw[2] == 0
    assert raw[1][0] == {"type": "BlockStored", "block_hashes": [external_hash(hash(k2))],
                         "parent_block_hash": external_hash(hash(k1)), "token_ids": [3, 4], "block_size": 2,
                         "lora_id": None, "medium": "GPU", "lora_name": None}
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [external_hash(hash(k2))], "medium": "GPU"}
    assert raw[1][2] == {"type": "AllBlocksCleared"}


def test_config_is_checked():
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
                                   '"tcp://127.0.0.1:5557", "topic": "kv-events"}')
    assert cfg.active and cfg.topic == "kv-events"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true}').active  # publisher null
    with pytest.raises(ValueError, match="enable_kv_events"):
        KVEventsConfig.from_json('{"enable_kv_events": true}')
    with pytest.raises(ValueError, match="buffer_steps"):
        KVEventsConfig.from_json('{"buffer_steps": 0}')
    with pytest.raises(ValueError, match="not valid JSON"):
        KVEventsConfig.from_json("{")


def chain_hashes(ids: list[int]) -> list[int]:
    """What the engine hashes for the full blocks of ``ids``, computed here independently."""
    out, parent = [], ROOT_HASH
    for i in range(len(ids) // BS):
        parent = hash((parent, tuple(ids[i * BS:(i + 1) * BS])))
        out.append(external_hash(parent))
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    replay_port = free_port()
    # The publisher binds an ipc:// endpoint (vLLM's rule: ipc, inproc and wildcard addresses bind); a router on
    # another host would use tcp://*:PORT.
    endpoint = f"ipc://{tmp_path_factory.mktemp('kv-events')}/pub.sock"
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                         replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv-events")
    ckpt = shared_checkpoint(tmp_path_factory)
    with InProcessServer(ckpt, server_kw={"kv_events": cfg}, dtype="float32", max_model_len=512,
                         num_kv_blocks=20, block_size=BS) as s:
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        yield s, sub, ctx, replay_port
    sub.close(0)
    ctx.term()


def receive(sub, until, timeout_s: float = 20.0) -> list[tuple[int, KVEventBatch]]:
    got, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            got.append((int.from_bytes(seq, "big"), decode_batch(payload)))
            if until([e for _, b in got for e in b.events]):
                return got
    raise AssertionError(f"events never arrived; got {got}")


def complete(server, prompt: str, max_tokens: int = 2) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text


def tokens(server, prompt: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=10).json()["tokens"]


def test_events_over_zmq(setup):
    server, sub, ctx, replay_port = setup
    time.sleep(0.3)  # the publisher's connection to our SUB socket (and our subscription) settles
    a = "the quick brown fox jumps over the lazy dog, " * 3  # 135 chars
    b = a[:80] + "a different ending follows here, quite unlike the first"
    ha, hb = chain_hashes(tokens(server, a)), chain_hashes(tokens(server, b))
    shared = [x for x, y in zip(ha, hb) if x == y]
    assert len(shared) >= 4 and len(ha) >= 8  # the two prompts share their first blocks

    def stored(events):
        return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]

    complete(server, a)
    got = receive(sub, lambda ev: set(ha) <= set(stored(ev)))
    ev_a = [e for _, batch in got for e in batch.events]
    first = next(e for e in ev_a if isinstance(e, BlockStored))
    assert first.parent_block_hash is None and first.block_size == BS and len(first.token_ids) == BS
    assert first.token_ids == tokens(server, a)[:BS] and first.medium == "GPU"
    by_hash = {e.block_hashes[0]: e for e in ev_a if isinstance(e, BlockStored)}
    for parent, child in zip(ha, ha[1:]):
        assert by_hash[child].parent_block_hash == parent

    complete(server, b)  # the shared prefix is a cache hit: only b's own blocks are stored, chained onto a's
    got = receive(sub, lambda ev: set(hb) - set(shared) <= set(stored(ev)))
    ev_b = stored([e for _, batch in got for e in batch.events])
    assert not set(shared) & set(ev_b)
    assert by_hash.get(hb[len(shared)]) is None

    # 20 blocks in the pool: a long new prompt takes the free (cached) blocks, evicting a's and b's.
    c = "".join(chr(ord("A") + (i * 7) % 26) for i in range(290))
    complete(server, c)
    got = receive(sub, lambda ev: any(isinstance(e, BlockRemoved) for e in ev))
    time.sleep(0.5)
    while sub.poll(100):
        got.append((0, decode_batch(sub.recv_multipart()[2])))
    removed = {h for _, batch in got for e in batch.events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed and removed <= set(ha) | set(hb)

    assert httpx.post(server.url + "/reset_prefix_cache", timeout=10).status_code == 200
    got = receive(sub, lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev))

    # The replay socket resends every buffered batch from a sequence number, then the end marker.
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed = []
    while True:
        assert dealer.poll(5000)
        _, seq, payload = dealer.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        replayed.append(decode_batch(payload))
    dealer.close(0)
    all_stored = stored([e for batch in replayed for e in batch.events])
    assert set(ha) | set(hb) <= set(all_stored)
    assert isinstance(replayed[-1].events[-1], AllBlocksCleared)
