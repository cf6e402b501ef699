"""Block tables for a model with a ``full`` and a ``window`` KV group (DeepSeek-V4). Pure Python.

The full group (compressed entries, read for the whole sequence life) works exactly like ``KVCacheManager``.
The window group (token-level state read only within ``lookback_tokens`` before the query) has its own pool
and a per-request table of the same logical length. After each step, window blocks lying wholly before
``num_computed_tokens - lookback_tokens`` are released: the table keeps a placeholder there (never read, sent to
the model as block ``NULL_BLOCK``), the block keeps its prefix hash and joins the pool's LRU free queue, so it
still serves prefix hits until it is evicted.

Prefix hits: a full-group hit of h blocks is usable only if the window pool still caches the blocks covering
[h*bs - lookback, h*bs) (what the first recomputed query reads); the largest such h wins (h = 0 always works).
Both groups are hashed with the same chain keys, so the two blocks at one index hold the same prefix's state.
"""
from __future__ import annotations

from openinfer.engine.block_pool import BlockPool, KVBlock
from openinfer.engine.kv_cache_manager import KVCacheManager
from openinfer.engine.request import Request

# Block id written into window tables at released positions. Any id works: the model never reads them.
NULL_BLOCK = 0

# A hit as the scheduler passes it back to allocate_slots: (full block, window block or None) per index.
HitPair = tuple[KVBlock, KVBlock | None]


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, num_window_blocks: int, block_size: int, lookback_tokens: int,
                 enable_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        self.lookback_tokens = lookback_tokens
        self.window_pool = BlockPool(num_window_blocks, enable_caching)
        self.win_blocks: dict[str, list[KVBlock | None]] = {}
        self._num_released: dict[str, int] = {}  # leading window indices already replaced by placeholders

    @property
    def num_free_window_blocks(self) -> int:
        return self.window_pool.num_free_blocks

    def window_block_ids(self, request_id: str) -> list[int]:
        return [NULL_BLOCK if b is None else b.block_id for b in self.win_blocks.get(request_id, ())]

    def num_held_window_blocks(self, request_id: str) -> int:
        return sum(b is not None for b in self.win_blocks.get(request_id, ()))

    def _first_live(self, num_computed: int) -> int:
        """First window block index a request with ``num_computed`` computed tokens may still read."""
        return max(0, num_computed - self.lookback_tokens) // self.block_size

    # -- prefix hits -----------------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[HitPair], int]:
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        full = self._cached_prefix(req)
        keys = self._block_keys(req, len(full))
        for h in range(len(full), -1, -1):
            lo = self._first_live(h * self.block_size)
            window = [self.window_pool.get_cached_block(k) for k in keys[lo:h]]
            if all(b is not None for b in window):
                break
        hits = list(zip(full[:h], [None] * lo + window))
        self.stats.queries += req.num_tokens
        self.stats.hits += h * self.block_size
        return hits, h * self.block_size

    # -- allocation ------------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[HitPair] | None = None) -> list[KVBlock] | None:
        hits = new_computed_blocks or []
        full_hits = [f for f, _ in hits]
        win_hits = [w for _, w in hits if w is not None]
        rid = req.request_id
        blocks = self.req_blocks.setdefault(rid, [])
        wblocks = self.win_blocks.setdefault(rid, [])
        total = req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_required = -(-total // self.block_size)
        num_new = max(0, num_required - len(blocks) - len(hits))  # both tables have the same length
        full_need = num_new + sum(1 for b in full_hits if b.ref_cnt == 0)
        win_need = num_new + sum(1 for b in win_hits if b.ref_cnt == 0)
        if full_need > self.pool.num_free_blocks or win_need > self.window_pool.num_free_blocks:
            if not blocks:
                self.req_blocks.pop(rid, None)
                self.win_blocks.pop(rid, None)
            return None
        self.pool.touch(full_hits)
        self.window_pool.touch(win_hits)
        blocks.extend(full_hits)
        wblocks.extend(w for _, w in hits)
        if hits:
            self._num_released[rid] = self._first_live(len(hits) * self.block_size)
        new_blocks = self.pool.allocate(num_new)
        blocks.extend(new_blocks)
        wblocks.extend(self.window_pool.allocate(num_new))
        self._cache_full_blocks(req, total)
        return new_blocks

    def _cache_full_blocks(self, req: Request, num_tokens_after_step: int) -> None:
        start = self._num_cached_blocks.get(req.request_id, 0)
        super()._cache_full_blocks(req, num_tokens_after_step)
        end = self._num_cached_blocks.get(req.request_id, 0)
        if end <= start:
            return
        keys = self._block_keys(req, end)
        wblocks = self.win_blocks[req.request_id]
        for i in range(start, end):
            if wblocks[i] is not None:
                self.window_pool.cache_block(wblocks[i], keys[i])

    def release_stale_blocks(self, req: Request) -> None:
        """Release the window blocks no future query of ``req`` reads (oldest first, so they are evicted
        first). They are full and already hashed, so they stay available to prefix hits until evicted."""
        wblocks = self.win_blocks.get(req.request_id)
        if not wblocks:
            return
        start = self._num_released.get(req.request_id, 0)
        end = min(len(wblocks), self._first_live(req.num_computed_tokens))
        if end <= start:
            return
        stale = [b for b in wblocks[start:end] if b is not None]
        wblocks[start:end] = [None] * (end - start)
        self._num_released[req.request_id] = end
        self.window_pool.release(stale)

    def free(self, req: Request) -> None:
        wblocks = self.win_blocks.pop(req.request_id, [])
        self._num_released.pop(req.request_id, None)
        super().free(req)
        self.window_pool.release([b for b in reversed(wblocks) if b is not None])

    def reset_prefix_cache(self) -> int:
        n = super().reset_prefix_cache()
        self.window_pool.reset_prefix_cache()
        return n
