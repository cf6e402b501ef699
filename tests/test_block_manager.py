"""Block pool and KV cache manager: exact block ids, ref counts, hits and eviction order. No torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

from openinfer.engine.block_pool import BlockPool
from openinfer.engine.kv_cache_manager import KVCacheManager
from openinfer.engine.request import Request
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.sampling_params import SamplingParams

BS = 4


def one_group(num_blocks: int, enable_caching: bool = True) -> KVCacheManager:
    """A dense model's manager: one whole-life group."""
    return KVCacheManager([KVGroupSpec("full", 64)], {"full": num_blocks}, BS, enable_caching)


def hit_ids(hits) -> list[int]:
    return [b.block_id for b in hits.blocks[0]]


def req(rid: str, tokens: list[int], **sp) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8, **sp), max_model_len=1024)


def schedule_all(kv: KVCacheManager, r: Request) -> list[int]:
    """What the scheduler does for a waiting request: look up hits, allocate the rest, mark computed."""
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = r.num_tokens
    return kv.block_ids(r.request_id)[0]


def test_core_modules_import_without_torch():
    code = ("import sys; import openinfer.engine.scheduler, openinfer.engine.kv_cache_manager, "
            "openinfer.engine.kv_plan, openinfer.config, openinfer.kv_cache_interface, openinfer.step_io; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocation_takes_lowest_free_ids_in_order():
    kv = one_group(8)
    a = req("a", list(range(10)))  # 10 tokens -> 3 blocks
    assert schedule_all(kv, a) == [0, 1, 2]
    b = req("b", list(range(100, 105)))
    assert schedule_all(kv, b) == [3, 4]
    assert kv.groups[0].pool.num_free_blocks == 3
    assert [blk.ref_cnt for blk in kv.groups[0].pool.blocks] == [1, 1, 1, 1, 1, 0, 0, 0]


def test_prefix_hit_shares_full_blocks_and_never_the_last_token():
    kv = one_group(10)
    a = req("a", list(range(12)))  # exactly 3 full blocks
    assert schedule_all(kv, a) == [0, 1, 2]
    b = req("b", list(range(12)))  # identical prompt: last token must be recomputed
    hits, n = kv.get_computed_blocks(b)
    assert hit_ids(hits) == [0, 1] and n == 8
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is not None
    assert kv.block_ids("b")[0] == [0, 1, 3]
    assert [kv.groups[0].pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    c = req("c", list(range(8)) + [99, 98, 97, 96, 95])  # shares 2 blocks, then diverges
    hits, n = kv.get_computed_blocks(c)
    assert hit_ids(hits) == [0, 1] and n == 8
    assert kv.stats.hits == 16 and kv.stats.queries == 12 + 12 + 13


def test_stored_tokens_are_checked_not_just_hashes():
    kv = one_group(6)
    a = req("a", [1, 2, 3, 4, 5])
    schedule_all(kv, a)
    key = next(iter(kv.groups[0].pool._cached))
    parent, tokens = key
    forged = req("x", [9, 9, 9, 9, 5])
    forged.block_hashes = [hash(key)]  # same memoised hash, different tokens: must miss
    hits, n = kv.get_computed_blocks(forged)
    assert hit_ids(hits) == [] and n == 0


def test_free_returns_blocks_tail_first_and_lru_eviction_order():
    kv = one_group(6)
    a = req("a", list(range(9)))  # blocks 0,1 full + 2 partial
    schedule_all(kv, a)
    b = req("b", list(range(50, 58)) + [1])
    schedule_all(kv, b)  # blocks 3,4 full + 5 partial
    kv.free(a)
    # Tail first: a's partial block 2, then 1, then 0 join the free queue.
    assert kv.groups[0].pool.free_block_ids() == [2, 1, 0]
    kv.free(b)
    assert kv.groups[0].pool.free_block_ids() == [2, 1, 0, 5, 4, 3]
    assert kv.groups[0].pool.num_free_blocks == 6
    # a's cached prefix is still there until evicted...
    a2 = req("a2", list(range(9)))
    hits, n = kv.get_computed_blocks(a2)
    assert hit_ids(hits) == [0, 1]
    # ...and allocation evicts least recently freed first: block 2 (uncached), then 1, dropping its hash.
    c = req("c", list(range(200, 207)))
    schedule_all(kv, c)
    assert kv.block_ids("c")[0] == [2, 1]
    hits, n = kv.get_computed_blocks(req("a3", list(range(9))))
    assert hit_ids(hits) == [0]  # block 1's content is gone, the chain stops there


def test_hit_on_free_block_counts_against_capacity():
    kv = one_group(3)
    a = req("a", list(range(9)))
    schedule_all(kv, a)
    kv.free(a)  # 0,1 cached and free; 2 free
    b = req("b", list(range(9)) + [7, 7, 7, 7])  # hits 0,1 then needs 2 more blocks: 4 > 3 total
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is None
    assert kv.groups[0].pool.num_free_blocks == 3 and all(blk.ref_cnt == 0 for blk in kv.groups[0].pool.blocks)
    assert "b" not in kv.groups[0].tables


def test_decode_growth_caches_block_when_it_fills():
    kv = one_group(4)
    a = req("a", [1, 2, 3])
    schedule_all(kv, a)
    assert kv.block_ids("a")[0] == [0] and not kv.groups[0].pool._cached
    a.append_output_token(4)  # token 4 fills block 0 once computed
    assert kv.allocate_slots(a, 1).block_ids() == [[]]
    assert len(kv.groups[0].pool._cached) == 1
    a.num_computed_tokens += 1
    a.append_output_token(5)
    new = kv.allocate_slots(a, 1)
    assert new.block_ids() == [[1]]


def test_prefix_caching_disabled_and_prompt_logprobs_skip_lookup():
    kv = one_group(6, enable_caching=False)
    schedule_all(kv, req("a", list(range(9))))
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 0
    kv2 = one_group(6)
    schedule_all(kv2, req("a", list(range(9))))
    assert kv2.get_computed_blocks(req("b", list(range(9)), prompt_logprobs=1))[1] == 0


def test_reset_prefix_cache_and_double_free_guard():
    kv = one_group(4)
    a = req("a", list(range(9)))
    schedule_all(kv, a)
    assert kv.reset_prefix_cache() == 2
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 0
    pool = BlockPool(2, True)
    blocks = pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(blocks)
