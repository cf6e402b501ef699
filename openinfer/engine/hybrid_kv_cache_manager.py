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

Optionally a coarse group (kv_groups.py): full-life state with one block per ``coarse_block_tokens`` tokens
(r ordinary blocks). Coarse block k is hashed with the key of ordinary block (k+1)*r - 1, once that block is
full, and a hit of h ordinary blocks also needs the coarse blocks 0 .. h*bs // coarse_block_tokens - 1 cached.
"""
from __future__ import annotations

from dataclasses import dataclass

from openinfer.engine.block_pool import BlockPool, KVBlock
from openinfer.engine.kv_cache_manager import KVCacheManager
from openinfer.engine.request import Request

# Block id written into window tables at released positions. Any id works: the model never reads them.
NULL_BLOCK = 0


@dataclass
class HybridHit:
    """A prefix hit as the scheduler passes it back to allocate_slots (opaque to the scheduler)."""

    full: list[KVBlock]
    window: list[KVBlock | None]  # same length; None where the first recomputed query cannot read
    coarse: list[KVBlock]


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, num_window_blocks: int, block_size: int, lookback_tokens: int,
                 enable_caching: bool = True, num_coarse_blocks: int = 0,
                 coarse_block_tokens: int | None = None) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        self.lookback_tokens = lookback_tokens
        self.window_pool = BlockPool(num_window_blocks, enable_caching)
        self.win_blocks: dict[str, list[KVBlock | None]] = {}
        self._num_released: dict[str, int] = {}  # leading window indices already replaced by placeholders
        self.coarse_pool: BlockPool | None = None
        self.coarse_blocks: dict[str, list[KVBlock]] = {}
        self.coarse_block_tokens = coarse_block_tokens
        if coarse_block_tokens is not None:
            if coarse_block_tokens % block_size:
                raise ValueError(f"coarse blocks of {coarse_block_tokens} tokens are not a whole number of "
                                 f"{block_size}-token blocks")
            self.coarse_pool = BlockPool(num_coarse_blocks, enable_caching)
            self._coarse_ratio = coarse_block_tokens // block_size

    @property
    def num_free_window_blocks(self) -> int:
        return self.window_pool.num_free_blocks

    def window_block_ids(self, request_id: str) -> list[int]:
        return [NULL_BLOCK if b is None else b.block_id for b in self.win_blocks.get(request_id, ())]

    def coarse_block_ids(self, request_id: str) -> list[int] | None:
        if self.coarse_pool is None:
            return None
        return [b.block_id for b in self.coarse_blocks.get(request_id, ())]

    @property
    def pools(self) -> list[BlockPool]:
        return [self.pool, self.window_pool] + ([self.coarse_pool] if self.coarse_pool is not None else [])

    def num_held_window_blocks(self, request_id: str) -> int:
        return sum(b is not None for b in self.win_blocks.get(request_id, ()))

    def _first_live(self, num_computed: int) -> int:
        """First window block index a request with ``num_computed`` computed tokens may still read."""
        return max(0, num_computed - self.lookback_tokens) // self.block_size

    # -- prefix hits -----------------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[HybridHit | list, int]:
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        full = self._cached_prefix(req)
        keys = self._block_keys(req, len(full))
        coarse: list[KVBlock] = []
        if self.coarse_pool is not None:  # the leading coarse blocks still cached
            r = self._coarse_ratio
            for k in range(len(full) // r):
                block = self.coarse_pool.get_cached_block(keys[(k + 1) * r - 1])
                if block is None:
                    break
                coarse.append(block)
        for h in range(len(full), -1, -1):
            if self.coarse_pool is not None and h // self._coarse_ratio > len(coarse):
                continue
            lo = self._first_live(h * self.block_size)
            window = [self.window_pool.get_cached_block(k) for k in keys[lo:h]]
            if all(b is not None for b in window):
                break
        n_coarse = h // self._coarse_ratio if self.coarse_pool is not None else 0
        self.stats.queries += req.num_tokens
        self.stats.hits += h * self.block_size
        if h == 0:
            return [], 0
        return HybridHit(full[:h], [None] * lo + window, coarse[:n_coarse]), h * self.block_size

    # -- allocation ------------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: HybridHit | list | None = None) -> list[KVBlock] | None:
        hit = new_computed_blocks if isinstance(new_computed_blocks, HybridHit) else HybridHit([], [], [])
        win_hits = [w for w in hit.window if w is not None]
        rid = req.request_id
        blocks = self.req_blocks.setdefault(rid, [])
        wblocks = self.win_blocks.setdefault(rid, [])
        cblocks = self.coarse_blocks.setdefault(rid, []) if self.coarse_pool is not None else []
        total = req.num_computed_tokens + len(hit.full) * self.block_size + num_new_tokens
        num_new = max(0, -(-total // self.block_size) - len(blocks) - len(hit.full))  # same for full and window tables
        needs = [(self.pool, num_new, hit.full), (self.window_pool, num_new, win_hits)]
        num_new_coarse = 0
        if self.coarse_pool is not None:
            num_new_coarse = max(0, -(-total // self.coarse_block_tokens) - len(cblocks) - len(hit.coarse))
            needs.append((self.coarse_pool, num_new_coarse, hit.coarse))
        # Cache hits with no holder sit in the free queue; taking them costs free capacity too.
        if any(n + sum(1 for b in hits if b.ref_cnt == 0) > pool.num_free_blocks for pool, n, hits in needs):
            if not blocks:
                self.req_blocks.pop(rid, None)
                self.win_blocks.pop(rid, None)
                self.coarse_blocks.pop(rid, None)
            return None
        self.pool.touch(hit.full)
        self.window_pool.touch(win_hits)
        blocks.extend(hit.full)
        wblocks.extend(hit.window)
        if hit.full:
            self._num_released[rid] = self._first_live(len(hit.full) * self.block_size)
        new_blocks = self.pool.allocate(num_new)
        blocks.extend(new_blocks)
        wblocks.extend(self.window_pool.allocate(num_new))
        if self.coarse_pool is not None:
            self.coarse_pool.touch(hit.coarse)
            cblocks.extend(hit.coarse)
            cblocks.extend(self.coarse_pool.allocate(num_new_coarse))
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
            if self.coarse_pool is not None and (i + 1) % self._coarse_ratio == 0:
                # Coarse block k is complete once ordinary block (k+1)*r - 1 is: key it the same way.
                self.coarse_pool.cache_block(self.coarse_blocks[req.request_id][(i + 1) // self._coarse_ratio - 1],
                                             keys[i])

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
        cblocks = self.coarse_blocks.pop(req.request_id, [])
        super().free(req)
        self.window_pool.release([b for b in reversed(wblocks) if b is not None])
        if self.coarse_pool is not None:
            self.coarse_pool.release(list(reversed(cblocks)))

    def reset_prefix_cache(self) -> int:
        n = super().reset_prefix_cache()
        self.window_pool.reset_prefix_cache()
        if self.coarse_pool is not None:
            self.coarse_pool.reset_prefix_cache()
        return n
