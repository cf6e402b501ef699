"""One KV group's blocks: its pool, each request's block table, and the group's policy. Pure Python.

A group (``kv_cache_interface.KVGroupSpec``) is either *whole-life* (every row is read for the sequence's whole
life) or *sliding* (a query at p reads rows >= p - lookback only). Both can use blocks larger than the engine's
block size (``r`` tokens, a multiple ``c`` of it); group block j is hashed with the chain key of the last
ordinary block it covers, (j+1)*c - 1, so a block is only ever shared by sequences that agree on all its tokens.

Sliding groups release a running sequence's blocks that lie wholly behind the lookback: the table keeps a
placeholder there (``None``; ``NULL_BLOCK`` when sent to the model, never read), the block keeps its prefix hash
and joins the pool's LRU free queue, so it still serves prefix hits until it is evicted.
"""
from __future__ import annotations

from openinfer.engine.block_pool import BlockKey, BlockPool, KVBlock
from openinfer.kv_cache_interface import KVGroupSpec

# Block id sent for a released / never-needed position of a sliding group's table. Any id works: it is never read.
NULL_BLOCK = 0


class KVGroup:
    """A whole-life group: tables grow as tokens are computed and only shrink when the request ends."""

    def __init__(self, spec: KVGroupSpec, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        spec.check(block_size)
        self.spec = spec
        self.name = spec.name
        self.tokens_per_block = spec.tokens_per_block(block_size)
        self.ratio = self.tokens_per_block // block_size  # ordinary blocks per group block
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: dict[str, list[KVBlock | None]] = {}
        self._num_cached: dict[str, int] = {}  # leading group blocks already registered in the prefix cache

    # -- policy ------------------------------------------------------------------------------------------
    def first_needed(self, num_tokens: int) -> int:
        """First group block a query at position ``num_tokens`` (or any later one) may read."""
        return 0

    def release_stale(self, request_id: str, num_computed: int) -> None:
        """Whole-life groups keep every block until the request ends."""

    # -- prefix hits -------------------------------------------------------------------------------------
    def key_of(self, keys: list[BlockKey], j: int) -> BlockKey:
        return keys[(j + 1) * self.ratio - 1]

    def max_hit_blocks(self, keys: list[BlockKey]) -> int:
        """Largest hit, in ordinary blocks, this group allows: its leading cached blocks plus the part of the
        next group block that a hit may leave to be recomputed."""
        n = 0
        while (n + 1) * self.ratio <= len(keys) and self.pool.get_cached_block(self.key_of(keys, n)) is not None:
            n += 1
        return n * self.ratio + self.ratio - 1

    def hit_blocks(self, keys: list[BlockKey], num_tokens: int) -> list[KVBlock | None] | None:
        """The table prefix for a hit of ``num_tokens`` (a whole number of ordinary blocks): the cached blocks the
        first recomputed query reads, ``None`` before them; None if one of them is not cached."""
        end = num_tokens // self.tokens_per_block
        lo = min(self.first_needed(num_tokens), end)
        blocks: list[KVBlock | None] = [None] * lo
        for j in range(lo, end):
            block = self.pool.get_cached_block(self.key_of(keys, j))
            if block is None:
                return None
            blocks.append(block)
        return blocks

    # -- allocation --------------------------------------------------------------------------------------
    def num_new_blocks(self, request_id: str, total_tokens: int, hit: list[KVBlock | None]) -> int:
        table = self.tables.get(request_id, ())
        return max(0, -(-total_tokens // self.tokens_per_block) - len(table) - len(hit))

    def fits(self, num_new: int, hit: list[KVBlock | None]) -> bool:
        # Cache hits with no holder sit in the free queue; taking them costs free capacity too.
        return num_new + sum(1 for b in hit if b is not None and b.ref_cnt == 0) <= self.pool.num_free_blocks

    def allocate(self, request_id: str, hit: list[KVBlock | None], num_new: int) -> list[KVBlock]:
        table = self.tables.setdefault(request_id, [])
        self.pool.touch([b for b in hit if b is not None])
        table.extend(hit)
        new = self.pool.allocate(num_new)
        table.extend(new)
        return new

    def drop_if_empty(self, request_id: str) -> None:
        if not self.tables.get(request_id, True):
            del self.tables[request_id]

    def cache_full_blocks(self, request_id: str, num_full_ordinary: int, keys: list[BlockKey]) -> None:
        """Register the group blocks that ``num_full_ordinary`` full ordinary blocks complete."""
        end = num_full_ordinary // self.ratio
        start = self._num_cached.get(request_id, 0)
        if end <= start:
            return
        table = self.tables[request_id]
        for j in range(start, end):
            if table[j] is not None:
                self.pool.cache_block(table[j], self.key_of(keys, j))
        self._num_cached[request_id] = end

    def free(self, request_id: str) -> None:
        """Tail first, so the tail of a prefix (least likely to be shared) is evicted before its head."""
        table = self.tables.pop(request_id, [])
        self._num_cached.pop(request_id, None)
        self.pool.release([b for b in reversed(table) if b is not None])

    def block_ids(self, request_id: str, placeholder: int = NULL_BLOCK) -> list[int]:
        return [placeholder if b is None else b.block_id for b in self.tables.get(request_id, ())]

    def num_held(self, request_id: str) -> int:
        return sum(b is not None for b in self.tables.get(request_id, ()))

    def reset_prefix_cache(self) -> int:
        for rid in self._num_cached:
            self._num_cached[rid] = 0
        return self.pool.reset_prefix_cache()


class SlidingWindowGroup(KVGroup):
    """A group read only within ``lookback_tokens`` before the query (see the module docstring)."""

    def __init__(self, spec: KVGroupSpec, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        super().__init__(spec, num_blocks, block_size, enable_caching)
        self.lookback_tokens = spec.lookback_tokens
        self._num_released: dict[str, int] = {}  # leading table positions already replaced by placeholders

    def first_needed(self, num_tokens: int) -> int:
        return max(0, num_tokens - self.lookback_tokens) // self.tokens_per_block

    def max_hit_blocks(self, keys: list[BlockKey]) -> int:
        return len(keys)  # checked per candidate hit length in hit_blocks

    def allocate(self, request_id: str, hit: list[KVBlock | None], num_new: int) -> list[KVBlock]:
        if hit:
            self._num_released[request_id] = sum(b is None for b in hit)
        return super().allocate(request_id, hit, num_new)

    def release_stale(self, request_id: str, num_computed: int) -> None:
        """Release the blocks no future query reads (oldest first, so they are evicted first). They are full and
        already hashed, so they stay available to prefix hits until evicted."""
        table = self.tables.get(request_id)
        if not table:
            return
        start = self._num_released.get(request_id, 0)
        end = min(len(table), self.first_needed(num_computed))
        if end <= start:
            return
        stale = [b for b in table[start:end] if b is not None]
        table[start:end] = [None] * (end - start)
        self._num_released[request_id] = end
        self.pool.release(stale)

    def free(self, request_id: str) -> None:
        self._num_released.pop(request_id, None)
        super().free(request_id)


def make_group(spec: KVGroupSpec, num_blocks: int, block_size: int, enable_caching: bool) -> KVGroup:
    cls = SlidingWindowGroup if spec.sliding else KVGroup
    return cls(spec, num_blocks, block_size, enable_caching)
