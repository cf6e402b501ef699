"""The pool of KV blocks: free list in LRU order, ref counts and the prefix-cache map. Pure Python.

A block's identity in the prefix cache is its chain key ``(parent_hash, token_ids)``: dict lookups compare
the stored tokens, so a hash collision can never serve the wrong KV.

With ``record_events()`` the pool also records what KV-aware routers track (openinfer/kv_events.py): a block
stored in the cache, a cached block evicted, the whole cache cleared. ``take_events()`` hands them over.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from openinfer.kv_events import (MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored, EventRecorder, KVEvent,
                                 external_hash)

BlockKey = tuple[int, tuple[int, ...]]


def chain_key(parent_hash: int, token_ids: tuple[int, ...]) -> BlockKey:
    return (parent_hash, token_ids)


# The root of every chain; any fixed value works (keys also hold the tokens).
ROOT_HASH = 0x5EED


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    key: BlockKey | None = None  # set while the block holds a cached full block

    @property
    def block_hash(self) -> int | None:
        return None if self.key is None else hash(self.key)

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.key is not None})"


class BlockPool(EventRecorder):
    """Owns every block. Free blocks sit in an ordered queue: new allocations take from the front (least
    recently freed first), so cached prefixes freed last survive longest (LRU eviction)."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockKey, KVBlock] = {}
        self._events: list[KVEvent] | None = None  # None: not recording


    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (front is evicted first)."""
        return list(self._free)

    def get_cached_block(self, key: BlockKey) -> KVBlock | None:
        return self._cached.get(key) if self.enable_caching else None

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.key is not None:
            if self._cached.get(block.key) is block:
                del self._cached[block.key]
                if self._events is not None:
                    self._events.append(BlockRemoved([external_hash(hash(block.key))], MEDIUM))
            block.key = None

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache-hit blocks; a block with no holder leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block. Callers pass a request's blocks tail first, so the tail of a
        prefix (least likely to be shared) is evicted before its head."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache_block(self, block: KVBlock, key: BlockKey) -> None:
        if not self.enable_caching or block.key is not None:
            return
        # If an identical block is already cached, keep the first; this one stays private.
        if key in self._cached:
            return
        block.key = key
        self._cached[key] = block
        if self._events is not None:
            parent, tokens = key
            self._events.append(BlockStored([external_hash(hash(key))],
                                            None if parent == ROOT_HASH else external_hash(parent),
                                            list(tokens), len(tokens), None, MEDIUM, None))

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (blocks in use keep their data). Returns how many entries were dropped."""
        n = len(self._cached)
        for block in self._cached.values():
            block.key = None
        self._cached.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return n
