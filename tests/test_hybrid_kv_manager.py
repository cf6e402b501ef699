"""The two-group (full + window) block manager used by DeepSeek-V4: release behind the lookback, the prefix-hit
rule over both pools, capacity checks on both, and every block back on free/preemption. No torch."""
from __future__ import annotations

import subprocess
import sys

from openinfer.config import SchedulerConfig
from openinfer.engine.hybrid_kv_cache_manager import NULL_BLOCK, HybridKVCacheManager
from openinfer.engine.kv_groups import min_window_blocks, window_blocks_per_seq
from openinfer.engine.request import Request
from openinfer.engine.scheduler import RunnerOutput, SampledToken, Scheduler
from openinfer.sampling_params import SamplingParams

BS = 4
LOOKBACK = 5  # a query at p reads window rows >= p - 5: blocks floor((p - 5) / 4) onwards


def req(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_model_len=1024)


def schedule_all(kv: HybridKVCacheManager, r: Request) -> int:
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = r.num_tokens
    kv.release_stale_blocks(r)
    return n


def all_free(kv: HybridKVCacheManager) -> bool:
    return (kv.num_free_blocks == kv.pool.num_blocks and kv.num_free_window_blocks == kv.window_pool.num_blocks
            and not kv.req_blocks and not kv.win_blocks)


def test_hybrid_manager_imports_without_torch():
    code = ("import sys; import openinfer.engine.hybrid_kv_cache_manager, openinfer.engine.kv_groups; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_window_blocks_behind_the_lookback_are_released_but_stay_cached():
    kv = HybridKVCacheManager(num_blocks=32, num_window_blocks=8, block_size=BS, lookback_tokens=LOOKBACK)
    a = req("a", list(range(20)))
    assert schedule_all(kv, a) == 0
    # 20 computed: the next query (p = 20) reads rows >= 15, i.e. blocks 3 and 4; 0..2 are placeholders.
    assert kv.block_ids("a") == [0, 1, 2, 3, 4]
    assert kv.window_block_ids("a") == [NULL_BLOCK] * 3 + [3, 4]
    assert kv.num_held_window_blocks("a") == 2
    assert kv.window_pool.free_block_ids() == [5, 6, 7, 0, 1, 2]  # released oldest first: evicted first
    assert all(kv.window_pool.blocks[i].key is not None for i in range(5))  # still hashed
    kv.free(a)
    assert all_free(kv)


def test_hit_needs_the_window_blocks_before_the_hit_point_and_is_shortened_otherwise():
    kv = HybridKVCacheManager(num_blocks=32, num_window_blocks=8, block_size=BS, lookback_tokens=LOOKBACK)
    a = req("a", list(range(20)))
    schedule_all(kv, a)
    kv.free(a)  # window free queue: [5, 6, 7, 0, 1, 2, 4, 3]
    b = req("b", list(range(12)) + [90, 91, 92, 93, 94])
    # Full hit of 3 blocks; the first recomputed query (p = 12) reads rows 7..11: window blocks 1 and 2.
    assert schedule_all(kv, b) == 12
    assert kv.window_block_ids("b") == [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 5, 6]
    kv.free(b)  # b released 1, 2 (used by its hit) after a's 4, 3: queue [7, 0, 4, 3, 1, 2, 6, 5]
    x = req("x", list(range(500, 516)))  # an unrelated request evicts the four oldest: 7, 0, 4, 3
    hits, n = kv.get_computed_blocks(x)
    assert n == 0 and kv.allocate_slots(x, 16, hits) is not None
    assert kv.window_block_ids("x") == [7, 0, 4, 3]
    c = req("c", list(range(20)) + [99])
    hits, n = kv.get_computed_blocks(c)
    # The full pool still caches all 5 of a's blocks, but h = 5 needs window 3, 4 and h = 4 needs 2, 3:
    # evicted. h = 3 needs 1, 2: cached. So the hit is shortened to 12 tokens.
    assert n == 12 and [f.block_id for f in hits.full] == [0, 1, 2]
    assert [w and w.block_id for w in hits.window] == [None, 1, 2]
    kv.free(x)
    assert kv.allocate_slots(c, c.num_tokens - n, hits) is not None
    assert kv.block_ids("c")[:3] == [0, 1, 2] and kv.window_block_ids("c")[:3] == [NULL_BLOCK, 1, 2]
    kv.free(c)
    assert all_free(kv)


def test_no_window_blocks_means_no_admission():
    kv = HybridKVCacheManager(num_blocks=32, num_window_blocks=2, block_size=BS, lookback_tokens=LOOKBACK)
    a = req("a", list(range(12)))  # 3 blocks at once: the full pool has them, the window pool does not
    assert kv.allocate_slots(a, 12) is None
    assert all_free(kv) and kv.num_free_blocks == 32


def test_scheduler_preempts_on_window_shortage_and_window_use_stays_bounded():
    """Decode-heavy run on a window pool too small for three sequences at once (a decode here holds up to 3
    window blocks): the scheduler preempts, every sequence finishes, each holds at most ceil(lookback/bs) + 2
    window blocks while it decodes, and every block of both pools comes back."""
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8)
    per_seq = window_blocks_per_seq(LOOKBACK, BS, 1)
    assert per_seq == 4 and min_window_blocks(LOOKBACK, BS, 3, 8) == 14
    kv = HybridKVCacheManager(num_blocks=64, num_window_blocks=6, block_size=BS,
                              lookback_tokens=LOOKBACK)
    s = Scheduler(cfg, kv)
    reqs = [req(r, [100 * i + j for j in range(6)], max_tokens=40) for i, r in enumerate("abc")]
    for r in reqs:
        s.add_request(r)
    steps = 0
    while s.num_unfinished:
        out = s.schedule()
        for q in out.seqs:
            assert len(q.window_block_ids) == len(q.block_ids)
            if len(q.token_ids) == 1:
                assert kv.num_held_window_blocks(q.request_id) <= per_seq
        s.update_from_output(out, RunnerOutput({q.request_id: SampledToken(7) for q in out.seqs if q.sample}))
        steps += 1
        assert steps < 1000
    assert all(r.num_output_tokens == 40 for r in reqs)
    assert s.num_preemptions > 0
    assert all_free(kv)


def test_coarse_group_one_block_per_span_keyed_by_its_last_ordinary_block():
    """Coarse blocks span 2 ordinary blocks (8 tokens): block k is cached under the key of ordinary block
    2k + 1, and a hit of h ordinary blocks also needs coarse blocks 0 .. h*4 // 8 - 1."""
    kv = HybridKVCacheManager(num_blocks=32, num_window_blocks=16, block_size=BS, lookback_tokens=LOOKBACK,
                              num_coarse_blocks=4, coarse_block_tokens=8)
    a = req("a", list(range(22)))  # 6 ordinary blocks (5 full), 3 coarse blocks (2 complete)
    schedule_all(kv, a)
    assert kv.block_ids("a") == [0, 1, 2, 3, 4, 5] and kv.coarse_block_ids("a") == [0, 1, 2]
    keys = kv._block_keys(a, 5)
    assert kv.coarse_pool.get_cached_block(keys[1]).block_id == 0
    assert kv.coarse_pool.get_cached_block(keys[3]).block_id == 1
    assert kv.coarse_pool.blocks[2].key is None  # its span is not complete: never shared
    b = req("b", list(range(20)) + [77, 78])
    hits, n = kv.get_computed_blocks(b)  # 5 ordinary blocks -> coarse blocks 0, 1 (20 // 8 = 2)
    assert n == 20 and [c.block_id for c in hits.coarse] == [0, 1]
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is not None
    assert kv.coarse_block_ids("b") == [0, 1, 3]
    # The coarse pool is now exhausted (4 blocks): a new request needing one cannot be admitted.
    c = req("c", list(range(300, 305)))
    assert kv.get_computed_blocks(c) == ([], 0) and kv.allocate_slots(c, 5) is None
    kv.free(a), kv.free(b)
    # Evict coarse block 1 (a's second span, tokens 8..15): a later hit may not cover token 15, where that
    # entry is written, so it stops at 3 ordinary blocks (12 tokens; the window pool has blocks 1, 2).
    kv.coarse_pool._evict(kv.coarse_pool.blocks[1])
    hits, n = kv.get_computed_blocks(req("d", list(range(22))))
    assert n == 12 and [c.block_id for c in hits.coarse] == [0] and len(hits.full) == 3
    assert all(p.num_free_blocks == p.num_blocks for p in kv.pools) and not kv.coarse_blocks
