"""KV cache events in vLLM's wire format, for KV-aware routers (shared vocabulary: the block pool records them,
the server publishes them, subscribers decode them).

The schema is vLLM's (vllm/distributed/kv_events.py): msgspec structs in msgpack. An event is a map tagged with
its class name under ``"type"`` (``tag=True``, not ``array_like``): ``{"type": "BlockStored", "block_hashes": [...],
"parent_block_hash": ..., "token_ids": [...], "block_size": 16, "lora_id": null, "medium": "GPU", "lora_name":
null}``; a batch is the positional array ``[ts, events, data_parallel_rank]``. That is what vllm-router 0.1.17's
``kv_aware`` policy decodes: it refuses an event sent as a positional array ("KV event must be a tagged map", every
lookup then a miss) and a batch sent as a map ("KV event batch must be an array"). It re-hashes each block's
``token_ids`` itself (the block hashes only chain parents and name removals) and tokenizes requests with the
worker's ``/tokenize``, so ``block_size`` must equal its ``--kv-event-block-size``. No pickle anywhere.

Block hashes are openinfer's prefix-cache chain hashes (``hash((parent_hash, token_ids))`` of ints, the same in
every process) as unsigned 64-bit integers; a chain's first block has ``parent_block_hash=None``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

# vLLM's name for the primary KV tier (the device's own cache, whatever the device): routers give other tiers
# ("CPU", "DISK") a penalty, this one none.
MEDIUM = "GPU"
_U64 = (1 << 64) - 1


def external_hash(h: int) -> int:
    """A Python hash (signed 64-bit) as the unsigned 64-bit integer on the wire."""
    return h & _U64


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events: msgpack maps, the class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    # No defaults, as in vLLM: always on the wire (omit_defaults would drop a defaulted field).
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventRecorder:
    """The events a component (the block pool, the KV tier) records once asked to, until they are taken."""

    _events: list[KVEvent] | None = None  # None: not recording

    def record_events(self) -> None:
        if self._events is None:
            self._events = []

    def take_events(self) -> list[KVEvent]:
        if not self._events:
            return []
        out, self._events = self._events, []
        return out


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the engine step that produced the events ended
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``--kv-events-config`` (vLLM's field names and defaults). ``endpoint``: the PUB socket; like vLLM it binds
    when the address has ``*`` / ``::`` or is ipc:// / inproc://, and connects otherwise (to a subscriber that
    binds). ``replay_endpoint``: an optional ROUTER socket (always bound) that resends buffered batches from a
    sequence number."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv-events-config: {name} must be >= 1, got {getattr(self, name)}")
        if self.publisher == "zmq" and not self.endpoint:
            raise ValueError("kv-events-config: endpoint is required with publisher 'zmq'")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_json(cls, text: str | bytes) -> KVEventsConfig:
        try:
            return msgspec.json.decode(text, type=cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"--kv-events-config: {e}") from None
        except msgspec.DecodeError as e:
            raise ValueError(f"--kv-events-config is not valid JSON: {e}") from None


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()
