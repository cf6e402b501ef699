"""Block tables per request on top of the ``BlockPool``, with prefix caching. Pure Python.

Rules (shared with vLLM v1 / nano-vllm): only full blocks are hashed, each chained to its parent; a hit is
counted block by block from the start and stops at the first miss; the last prompt token is never served
from cache because its logits are needed to sample; blocks are ref-counted before use.
"""
from __future__ import annotations

from dataclasses import dataclass

from openinfer.engine.block_pool import ROOT_HASH, BlockPool, KVBlock, chain_key
from openinfer.engine.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache

    def reset(self) -> None:
        self.queries = 0
        self.hits = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # How many of a request's leading blocks are already registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def window_block_ids(self, request_id: str) -> list[int] | None:
        """The window group's block table (hybrid models only; see hybrid_kv_cache_manager)."""
        return None

    def coarse_block_ids(self, request_id: str) -> list[int] | None:
        """The coarse group's block table (hybrid models that declare one)."""
        return None

    def release_stale_blocks(self, req: Request) -> None:
        """Called after each step that advanced ``req``: a single full group has nothing to release."""

    def _block_keys(self, req: Request, num_full_blocks: int) -> list:
        """Chain keys of the request's first ``num_full_blocks`` full blocks (hashes memoised on the
        request so each block is hashed once in its life)."""
        bs = self.block_size
        keys = []
        parent = ROOT_HASH
        for i in range(num_full_blocks):
            key = chain_key(parent, tuple(req.all_token_ids[i * bs:(i + 1) * bs]))
            if i < len(req.block_hashes):
                parent = req.block_hashes[i]
            else:
                parent = hash(key)
                req.block_hashes.append(parent)
            keys.append(key)
        return keys

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of a waiting request, as blocks (not yet referenced) and a token count."""
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            # prompt_logprobs need the logits of every prompt position, so nothing may be skipped.
            return [], 0
        hits = self._cached_prefix(req)
        num_hit_tokens = len(hits) * self.block_size
        self.stats.queries += req.num_tokens
        self.stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def _cached_prefix(self, req: Request) -> list[KVBlock]:
        # Never the last token: its logits are needed, so at most (num_tokens - 1) tokens come from cache.
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for key in self._block_keys(req, max_blocks):
            block = self.pool.get_cached_block(key)
            if block is None:
                break
            hits.append(block)
        return hits

    # -- allocation ------------------------------------------------------------------------------
    def allocate_slots(
        self, req: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (plus cache hits). Returns
        the newly allocated blocks, or None (nothing changed) when the pool cannot fit them."""
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_required = -(-total // self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        # Cache hits with no holder sit in the free queue; taking them costs free capacity too.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks:
            if not blocks:
                self.req_blocks.pop(req.request_id, None)
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.allocate(num_new_blocks)
        blocks.extend(new_blocks)
        self._cache_full_blocks(req, total)
        return new_blocks

    def _cache_full_blocks(self, req: Request, num_tokens_after_step: int) -> None:
        """Register blocks that are full once this step has written them. Only tokens whose ids are known
        (prompt + sampled outputs) can be hashed, so the bound is ``req.num_tokens`` as well."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens_after_step, req.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        blocks = self.req_blocks[req.request_id]
        keys = self._block_keys(req, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], keys[i])
        self._num_cached_blocks[req.request_id] = num_full

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        self._num_cached_blocks.pop(req.request_id, None)
        self.pool.release(list(reversed(blocks)))

    def reset_prefix_cache(self) -> int:
        for rid in self._num_cached_blocks:
            self._num_cached_blocks[rid] = 0
        return self.pool.reset_prefix_cache()
