"""Block pool and KV cache manager: exact block ids, ref counts, hits and eviction order. No torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

from openinfer.engine.block_pool import BlockPool
from openinfer.engine.kv_cache_manager import KVCacheManager
from openinfer.engine.request import Request
from openinfer.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], **sp) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8, **sp), max_model_len=1024)


def schedule_all(kv: KVCacheManager, r: Request) -> list[int]:
    """What the scheduler does for a waiting request: look up hits, allocate the rest, mark computed."""
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = r.num_tokens
    return kv.block_ids(r.request_id)


def test_core_modules_import_without_torch():
    code = ("import sys; import openinfer.engine.scheduler, openinfer.engine.kv_cache_manager, "
            "openinfer.config; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocation_takes_lowest_free_ids_in_order():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("a", list(range(10)))  # 10 tokens -> 3 blocks
    assert schedule_all(kv, a) == [0, 1, 2]
    b = req("b", list(range(100, 105)))
    assert schedule_all(kv, b) == [3, 4]
    assert kv.num_free_blocks == 3
    assert [blk.ref_cnt for blk in kv.pool.blocks] == [1, 1, 1, 1, 1, 0, 0, 0]


def test_prefix_hit_shares_full_blocks_and_never_the_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = req("a", list(range(12)))  # exactly 3 full blocks
    assert schedule_all(kv, a) == [0, 1, 2]
    b = req("b", list(range(12)))  # identical prompt: last token must be recomputed
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is not None
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    c = req("c", list(range(8)) + [99, 98, 97, 96, 95])  # shares 2 blocks, then diverges
    hits, n = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert kv.stats.hits == 16 and kv.stats.queries == 12 + 12 + 13


def test_stored_tokens_are_checked_not_just_hashes():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = req("a", [1, 2, 3, 4, 5])
    schedule_all(kv, a)
    key = next(iter(kv.pool._cached))
    parent, tokens = key
    forged = req("x", [9, 9, 9, 9, 5])
    forged.block_hashes = [hash(key)]  # same memoised hash, different tokens: must miss
    hits, n = kv.get_computed_blocks(forged)
    assert hits == [] and n == 0


def test_free_returns_blocks_tail_first_and_lru_eviction_order():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = req("a", list(range(9)))  # blocks 0,1 full + 2 partial
    schedule_all(kv, a)
    b = req("b", list(range(50, 58)) + [1])
    schedule_all(kv, b)  # blocks 3,4 full + 5 partial
    kv.free(a)
    # Tail first: a's partial block 2, then 1, then 0 join the free queue.
    assert kv.pool.free_block_ids() == [2, 1, 0]
    kv.free(b)
    assert kv.pool.free_block_ids() == [2, 1, 0, 5, 4, 3]
    assert kv.num_free_blocks == 6
    # a's cached prefix is still there until evicted...
    a2 = req("a2", list(range(9)))
    hits, n = kv.get_computed_blocks(a2)
    assert [h.block_id for h in hits] == [0, 1]
    # ...and allocation evicts least recently freed first: block 2 (uncached), then 1, dropping its hash.
    c = req("c", list(range(200, 207)))
    schedule_all(kv, c)
    assert kv.block_ids("c") == [2, 1]
    hits, n = kv.get_computed_blocks(req("a3", list(range(9))))
    assert [h.block_id for h in hits] == [0]  # block 1's content is gone, the chain stops there


def test_hit_on_free_block_counts_against_capacity():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = req("a", list(range(9)))
    schedule_all(kv, a)
    kv.free(a)  # 0,1 cached and free; 2 free
    b = req("b", list(range(9)) + [7, 7, 7, 7])  # hits 0,1 then needs 2 more blocks: 4 > 3 total
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is None
    assert kv.num_free_blocks == 3 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    assert "b" not in kv.req_blocks


def test_decode_growth_caches_block_when_it_fills():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", [1, 2, 3])
    schedule_all(kv, a)
    assert kv.block_ids("a") == [0] and not kv.pool._cached
    a.append_output_token(4)  # token 4 fills block 0 once computed
    assert kv.allocate_slots(a, 1) == []
    assert len(kv.pool._cached) == 1
    a.num_computed_tokens += 1
    a.append_output_token(5)
    new = kv.allocate_slots(a, 1)
    assert [b.block_id for b in new] == [1]


def test_prefix_caching_disabled_and_prompt_logprobs_skip_lookup():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=False)
    schedule_all(kv, req("a", list(range(9))))
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 0
    kv2 = KVCacheManager(num_blocks=6, block_size=BS)
    schedule_all(kv2, req("a", list(range(9))))
    assert kv2.get_computed_blocks(req("b", list(range(9)), prompt_logprobs=1))[1] == 0


def test_reset_prefix_cache_and_double_free_guard():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(9)))
    schedule_all(kv, a)
    assert kv.reset_prefix_cache() == 2
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 0
    pool = BlockPool(2, True)
    blocks = pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(blocks)
