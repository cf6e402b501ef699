"""The offloading tier's files: one file per full block of a KV group, named by its prefix-cache chain hash and the
group's index. Pure Python.

Why one file per block, not an mmap'd arena: LRU eviction is an unlink and a store is a write to a temporary name
and a rename, so a crash mid-write leaves no half block under a real name; a corrupt file costs one block; the
index is rebuilt at start from the headers alone; and the OS page cache does the RAM caching an arena would need its
own allocator for. A block is tens of KiB to a few MiB, so the per-file cost (an inode, an open) stays small next
to the bytes.

A file is ``MAGIC``, a 4-byte little-endian header length, the msgpack ``TierHeader``, a 4-byte CRC-32 of header
and payload, then the payload: the block's rows of every KV store of its group, in module order. The header holds
the fingerprint of the model and KV layout (``tier_fingerprint``), the group and the whole chain key (chain hash,
parent hash, token ids), so an entry from another model or settings is never used and
a 64-bit hash collision never serves another prefix's KV. Files live in a folder per fingerprint, so two models
can share one path without seeing each other's blocks.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path

import msgspec

from openinfer.config import EngineConfig
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.kv_events import external_hash

MAGIC = b"OIKVTIER1\n"
_LEN = struct.Struct("<I")
SUFFIX = ".kvb"
# Bytes of each weight file hashed into the fingerprint (its start and its end): a fine-tune with the same
# config and file sizes still differs there, and reading 128 KiB per file keeps start-up fast.
_WEIGHT_SAMPLE = 64 << 10


class TierHeader(msgspec.Struct, array_like=True):
    fingerprint: str
    group: int
    block_hash: int
    parent_hash: int
    token_ids: list[int]
    payload_bytes: int
    rank: int = 0  # the tensor-parallel rank whose shard the payload is (0 with one rank)


class TierFileError(ValueError):
    """A tier file that must not be used (another model's, corrupt, not the block asked for)."""


def file_name(group: int, block_hash: int, rank: int | None = None) -> str:
    """One rank's file of a group block; ``rank`` None with one tensor-parallel rank (the whole block)."""
    return f"{external_hash(block_hash):016x}-{group}{'' if rank is None else f'.r{rank}'}{SUFFIX}"


def file_names(group: int, block_hash: int, tp: int) -> list[str]:
    """Every rank's file of a group block: the block is in the tier only while all of them are."""
    return [file_name(group, block_hash)] if tp == 1 else [file_name(group, block_hash, r) for r in range(tp)]


def encode(header: TierHeader, payload: bytes | memoryview) -> list[bytes | memoryview]:
    """The file's bytes, as parts to write in order (the payload is not copied)."""
    h = msgspec.msgpack.encode(header)
    crc = zlib.crc32(payload, zlib.crc32(h))
    return [MAGIC + _LEN.pack(len(h)) + h + _LEN.pack(crc), payload]


def read_header(f) -> tuple[TierHeader, int, int]:
    """(header, CRC, payload offset) from an open binary file positioned at its start."""
    head = f.read(len(MAGIC) + _LEN.size)
    if len(head) != len(MAGIC) + _LEN.size or not head.startswith(MAGIC):
        raise TierFileError("not a tier file (bad magic)")
    (n,) = _LEN.unpack_from(head, len(MAGIC))
    if n > 1 << 24:
        raise TierFileError("header length out of range")
    raw = f.read(n + _LEN.size)
    if len(raw) != n + _LEN.size:
        raise TierFileError("truncated header")
    try:
        header = msgspec.msgpack.decode(raw[:n], type=TierHeader)
    except msgspec.MsgspecError as e:
        raise TierFileError(f"unreadable header: {e}") from None
    (crc,) = _LEN.unpack_from(raw, n)
    return header, crc, len(head) + len(raw)


def read_block(f, fingerprint: str, group: int, block_hash: int, parent_hash: int, token_ids: list[int],
               payload_bytes: int, rank: int = 0) -> bytearray:
    """The payload of one block's file (an open binary stream at its start), after checking that it is this model's,
    this block's (this rank's shard of it) and intact."""
    with f:
        header, crc, _ = read_header(f)
        if header.fingerprint != fingerprint:
            raise TierFileError("another model or KV layout (fingerprint differs)")
        if (header.group, header.block_hash, header.parent_hash, header.token_ids) != (group, block_hash, parent_hash,
                                                                                       token_ids):
            raise TierFileError("holds another block (chain key differs)")
        if header.rank != rank:
            raise TierFileError(f"holds rank {header.rank}'s shard, not rank {rank}'s")
        payload = bytearray(payload_bytes)  # writable: the caller wraps it in a tensor without a copy
        n = f.readinto(payload)
        if header.payload_bytes != payload_bytes or n != payload_bytes or f.read(1):
            raise TierFileError(f"payload is not the {payload_bytes} bytes this model's blocks hold")
    if zlib.crc32(payload, zlib.crc32(msgspec.msgpack.encode(header))) != crc:
        raise TierFileError("checksum mismatch")
    return payload


def write_block(path: Path, parts: list[bytes | memoryview]) -> int:
    """Write to a temporary name and rename: a crash or a full disk never leaves a half file under the real name.
    Returns the bytes written; raises OSError (the disk is full, the folder gone) after removing the temporary."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for p in parts:
                f.write(p)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return sum(len(p) for p in parts)


def tier_fingerprint(config: EngineConfig, specs: list[KVGroupSpec], tier_groups: list[str]) -> str:
    """What makes stored KV reusable: the model (its config and a sample of every weight file), the dtypes, the
    quantisation, the block size and the KV groups' layout. Any difference gives another fingerprint."""
    m, c, sp = config.model, config.cache, config.speculative
    hf = {k: v for k, v in m.hf_config.items() if not k.startswith("_")}
    doc = {"hf_config": hf, "weights": _weight_samples(m.path), "dtype": str(m.dtype), "quantization": m.quantization,
           "kv_cache_dtype": c.kv_cache_dtype, "block_size": c.block_size, "tier_groups": tier_groups,
           "groups": [[s.name, s.bytes_per_block, s.block_tokens, s.lookback_tokens] for s in specs],
           # Each tensor-parallel rank stores its own shard of every block (files named per rank): another split
           # is another layout.
           "tensor_parallel_size": config.parallel.tensor_parallel_size}
    if sp is not None and sp.method != "ngram":  # the drafter's KV is stored too: its weights are part of the key
        doc["speculative"] = [sp.method, _weight_samples(sp.model) if sp.model else None]
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _weight_samples(path: str) -> list:
    weights = []
    root = Path(path)
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if p.suffix in (".safetensors", ".bin", ".pt", ".gguf") and p.is_file():
            size = p.stat().st_size
            with open(p, "rb") as f:
                head = f.read(_WEIGHT_SAMPLE)
                f.seek(max(0, size - _WEIGHT_SAMPLE))
                tail = f.read(_WEIGHT_SAMPLE)
            weights.append([p.name, size, hashlib.sha256(head + tail).hexdigest()])
    return weights
