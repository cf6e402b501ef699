"""Block tables per request for every KV group a model declares, with prefix caching. Pure Python.

The manager owns one ``KVGroup`` per ``KVGroupSpec`` (kv_groups.py: a pool each, and the group's policy) and
reconciles prefix hits across them in one place. The scheduler and the runner only ever see per-group lists of
block ids, in the model's group order; they never name a group.

Prefix-cache rules (shared with vLLM v1 / nano-vllm): only full blocks are hashed, each chained to its parent,
and the chain is shared by every group; a hit is counted block by block from the start; the last prompt token
is never served from cache because its logits are needed to sample; blocks are ref-counted before use. A hit of
h ordinary blocks is usable only if every group still caches what the first recomputed query reads: a whole-life
group its blocks before h, a sliding group its blocks within the lookback before h. The largest such h wins
(h = 0 always works).
"""
from __future__ import annotations

from dataclasses import dataclass

from openinfer.engine.block_pool import ROOT_HASH, BlockKey, KVBlock, chain_key
from openinfer.engine.kv_groups import NULL_BLOCK, KVGroup, make_group
from openinfer.engine.request import Request
from openinfer.kv_cache_interface import KVGroupSpec, blocks_for_tokens, check_groups, token_capacity


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache

    def reset(self) -> None:
        self.queries = 0
        self.hits = 0


@dataclass
class KVCacheBlocks:
    """Blocks per group, in the model's group order: a prefix hit (``num_tokens`` > 0) or newly allocated
    blocks. Opaque to the scheduler, which only passes it back or reads its ids."""

    blocks: tuple[list[KVBlock | None], ...]
    num_tokens: int = 0

    def block_ids(self) -> list[list[int]]:
        return [[NULL_BLOCK if b is None else b.block_id for b in g] for g in self.blocks]


class KVCacheManager:
    def __init__(self, specs: list[KVGroupSpec], num_blocks: dict[str, int], block_size: int,
                 enable_caching: bool = True) -> None:
        check_groups(specs, block_size)
        self.specs = list(specs)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups: list[KVGroup] = [make_group(s, num_blocks[s.name], block_size, enable_caching) for s in specs]
        self.num_blocks = {g.name: g.pool.num_blocks for g in self.groups}
        self.stats = PrefixCacheStats()
        # How many leading ordinary blocks of each request are already registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}

    # -- queries -----------------------------------------------------------------------------------------
    def empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.groups))

    @property
    def usage(self) -> float:
        """The fullest pool's share of blocks in use: the resource that runs out first."""
        return max(g.pool.usage for g in self.groups)

    @property
    def pools(self):
        return [g.pool for g in self.groups]

    @property
    def token_capacity(self) -> int:
        return token_capacity(self.specs, self.num_blocks, self.block_size)

    def all_free(self) -> bool:
        """Every block of every pool free and no table left (what a drained engine must look like)."""
        return all(g.pool.num_free_blocks == g.pool.num_blocks and not g.tables for g in self.groups)

    def blocks_needed(self, num_tokens: int) -> dict[str, int]:
        """Whole-life blocks one request of ``num_tokens`` tokens holds at its end, per group."""
        return {g.name: blocks_for_tokens(num_tokens, g.tokens_per_block) for g in self.groups if not g.spec.sliding}

    def block_ids(self, request_id: str, placeholder: int = NULL_BLOCK) -> list[list[int]]:
        """Per group; ``placeholder`` stands for a released (or never needed) position of a sliding group."""
        return [g.block_ids(request_id, placeholder) for g in self.groups]

    def full_block_keys(self, req: Request, num_full_blocks: int) -> list[BlockKey]:
        """Chain keys (parent hash, token ids) of the request's first ``num_full_blocks`` full blocks; their chain
        hashes are ``req.block_hashes[:num_full_blocks]`` afterwards."""
        return self._block_keys(req, num_full_blocks)

    def blocks_to_offer(self, req: Request, keys: list[BlockKey]) -> list[list[int]]:
        """Per group, the pool block holding each of the request's group blocks whose keys ``keys`` cover (-1: none):
        its table's, or - where a sliding group already released it - the pool's cached block for that key while
        it has not been evicted (its rows are intact until the next forward)."""
        out = []
        for g in self.groups:
            table = g.tables.get(req.request_id, [])
            ids = []
            for j in range(min(len(keys) // g.ratio, len(table))):
                b = table[j]
                if b is None:
                    b = g.pool.get_cached_block(g.key_of(keys, j))
                ids.append(-1 if b is None else b.block_id)
            out.append(ids)
        return out

    def _block_keys(self, req: Request, num_full_blocks: int) -> list[BlockKey]:
        """Chain keys of the request's first ``num_full_blocks`` full blocks (hashes memoised on the request so
        each block is hashed once in its life)."""
        bs = self.block_size
        keys = []
        parent = ROOT_HASH
        for i in range(num_full_blocks):
            salt = req.block_salt(i * bs, (i + 1) * bs) if req.mm_images else ()
            # An image's positions hold the same placeholder id whatever the image: its content hash goes into
            # the chain (and so into every later block's key too).
            key = chain_key(hash((parent, salt)) if salt else parent, tuple(req.all_token_ids[i * bs:(i + 1) * bs]))
            if i < len(req.block_hashes):
                parent = req.block_hashes[i]
            else:
                parent = hash(key)
                req.block_hashes.append(parent)
            keys.append(key)
        return keys

    # -- KV cache events (kv_events.py) --------------------------------------------------------------------
    def event_group(self) -> KVGroup | None:
        """The group whose pool speaks for the prefix cache in KV events: the first whole-life group of ordinary
        blocks (a model's main attention cache). Other groups hold the same chain keys; a router needs one view."""
        for g in self.groups:
            if not g.spec.sliding and g.tokens_per_block == self.block_size:
                return g
        return None

    def record_events(self) -> bool:
        g = self.event_group() if self.enable_caching else None
        if g is not None:
            g.pool.record_events()
        return g is not None

    def take_events(self) -> list:
        g = self.event_group()
        return g.pool.take_events() if g is not None else []

    # -- prefix hits -------------------------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[KVCacheBlocks, int]:
        """Longest usable cached prefix of a waiting request, as blocks (not yet referenced) and a token count."""
        hit, h = self._longest_hit(req)
        if hit is None:  # caching off, or prompt_logprobs asked: nothing is looked up, nothing is counted
            return self.empty_blocks(), 0
        self.stats.queries += req.num_tokens
        self.stats.hits += h * self.block_size
        if h == 0:
            return self.empty_blocks(), 0
        return KVCacheBlocks(tuple(hit), h * self.block_size), h * self.block_size

    def cached_prefix_tokens(self, req: Request) -> int:
        """How many of the request's tokens this cache could supply now: ``get_computed_blocks``' count, without
        counting a query (the data-parallel placement asks every replica, engine/core.py)."""
        return self._longest_hit(req)[1] * self.block_size

    def _longest_hit(self, req: Request) -> tuple[list | None, int]:
        """(per group the hit blocks, or None when nothing may be looked up; the hit in blocks)."""
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            # prompt_logprobs need the logits of every prompt position, so nothing may be skipped.
            return None, 0
        # Never the last token: its logits are needed, so at most (num_tokens - 1) tokens come from cache.
        keys = self._block_keys(req, (req.num_tokens - 1) // self.block_size)
        h = min([len(keys)] + [g.max_hit_blocks(keys) for g in self.groups])
        hit: list = []
        while h > 0:
            hit = [g.hit_blocks(keys, h * self.block_size) for g in self.groups]
            if all(b is not None for b in hit):
                break
            h -= 1
        return hit, h

    # -- allocation --------------------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, hit: KVCacheBlocks | None = None,
                       cache: bool = True, num_lookahead_tokens: int = 0) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (plus the hit), and for
        ``num_lookahead_tokens`` slots after those (a drafter's chain writes there). Returns the newly allocated
        blocks per group, or None (nothing changed) when a pool cannot fit them. ``cache=False``: the blocks are
        not registered in the prefix cache yet (their KV is still being read from another instance; the next
        allocation for the request registers them)."""
        hit = hit or self.empty_blocks()
        rid = req.request_id
        written = req.num_computed_tokens + hit.num_tokens + num_new_tokens
        total = written + num_lookahead_tokens
        need = [g.num_new_blocks(rid, total, h) for g, h in zip(self.groups, hit.blocks)]
        if not all(g.fits(n, h) for g, n, h in zip(self.groups, need, hit.blocks)):
            return None
        new = KVCacheBlocks(tuple(g.allocate(rid, h, n) for g, h, n in zip(self.groups, hit.blocks, need)))
        if cache:
            # Only the rows this step's forward writes count: a block whose last positions are lookahead slots
            # is not full yet (its target rows there are written by a later step, or never if the request is
            # preempted or ends first), so caching it would serve stale rows to a later prefix hit.
            self._cache_full_blocks(req, written)
        return new

    def _cache_full_blocks(self, req: Request, num_tokens_after_step: int) -> None:
        """Register blocks that are full once this step has written them. Only tokens whose ids are known (prompt
        + sampled outputs) can be hashed, so the bound is ``req.num_tokens`` as well."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens_after_step, req.num_tokens) // self.block_size
        if num_full <= self._num_cached_blocks.get(req.request_id, 0):
            return
        keys = self._block_keys(req, num_full)
        for g in self.groups:
            g.cache_full_blocks(req.request_id, num_full, keys)
        self._num_cached_blocks[req.request_id] = num_full

    def release_stale_blocks(self, req: Request, num_tokens: int | None = None) -> None:
        """After a step advanced ``req``: sliding groups give back the blocks no query from position
        ``num_tokens`` (default: its computed tokens) on reads."""
        n = req.num_computed_tokens if num_tokens is None else num_tokens
        for g in self.groups:
            g.release_stale(req.request_id, n)

    def free(self, req: Request) -> None:
        self._num_cached_blocks.pop(req.request_id, None)
        for g in self.groups:
            g.free(req.request_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (blocks in use keep their data). Returns how many entries were dropped
        from the first group's pool."""
        for rid in self._num_cached_blocks:
            self._num_cached_blocks[rid] = 0
        return [g.reset_prefix_cache() for g in self.groups][0]
