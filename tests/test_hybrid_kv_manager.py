"""The block manager with DeepSeek-V4's groups (whole-life ``full`` + sliding ``window`` [+ ``coarse`` blocks of
several ordinary blocks]): release behind the lookback, the prefix-hit rule over every pool, capacity checks on
each, and every block back on free/preemption. No torch."""
from __future__ import annotations

import subprocess
import sys

from openinfer.config import SchedulerConfig
from openinfer.engine.kv_cache_manager import KVCacheManager
from openinfer.engine.kv_groups import NULL_BLOCK
from openinfer.engine.request import Request
from openinfer.engine.scheduler import Scheduler
from openinfer.kv_cache_interface import KVGroupSpec, min_sliding_blocks, sliding_blocks_per_seq
from openinfer.sampling_params import SamplingParams
from openinfer.step_io import ModelRunnerOutput, SampledToken

BS = 4
LOOKBACK = 5  # a query at p reads window rows >= p - 5: blocks floor((p - 5) / 4) onwards
FULL, WINDOW, COARSE = 0, 1, 2  # group order


def hybrid(num_blocks: int, num_window_blocks: int, num_coarse_blocks: int = 0,
           coarse_block_tokens: int | None = None) -> KVCacheManager:
    specs = [KVGroupSpec("full", 64), KVGroupSpec("window", 64, lookback_tokens=LOOKBACK)]
    blocks = {"full": num_blocks, "window": num_window_blocks}
    if coarse_block_tokens is not None:
        specs.append(KVGroupSpec("coarse", 64, block_tokens=coarse_block_tokens))
        blocks["coarse"] = num_coarse_blocks
    return KVCacheManager(specs, blocks, BS)


def ids(hit_blocks) -> list[int | None]:
    return [b and b.block_id for b in hit_blocks]


def req(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_model_len=1024)


def schedule_all(kv: KVCacheManager, r: Request) -> int:
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = r.num_tokens
    kv.release_stale_blocks(r)
    return n


def all_free(kv: KVCacheManager) -> bool:
    return kv.all_free()


def test_kv_groups_import_without_torch():
    code = ("import sys; import openinfer.engine.kv_cache_manager, openinfer.engine.kv_groups; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_window_blocks_behind_the_lookback_are_released_but_stay_cached():
    kv = hybrid(32, 8)
    a = req("a", list(range(20)))
    assert schedule_all(kv, a) == 0
    # 20 computed: the next query (p = 20) reads rows >= 15, i.e. blocks 3 and 4; 0..2 are placeholders.
    assert kv.block_ids("a")[FULL] == [0, 1, 2, 3, 4]
    assert kv.block_ids("a")[WINDOW] == [NULL_BLOCK] * 3 + [3, 4]
    assert kv.groups[WINDOW].num_held("a") == 2
    assert kv.groups[WINDOW].pool.free_block_ids() == [5, 6, 7, 0, 1, 2]  # released oldest first: evicted first
    assert all(kv.groups[WINDOW].pool.blocks[i].key is not None for i in range(5))  # still hashed
    kv.free(a)
    assert all_free(kv)


def test_hit_needs_the_window_blocks_before_the_hit_point_and_is_shortened_otherwise():
    kv = hybrid(32, 8)
    a = req("a", list(range(20)))
    schedule_all(kv, a)
    kv.free(a)  # window free queue: [5, 6, 7, 0, 1, 2, 4, 3]
    b = req("b", list(range(12)) + [90, 91, 92, 93, 94])
    # Full hit of 3 blocks; the first recomputed query (p = 12) reads rows 7..11: window blocks 1 and 2.
    assert schedule_all(kv, b) == 12
    assert kv.block_ids("b")[WINDOW] == [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 5, 6]
    kv.free(b)  # b released 1, 2 (used by its hit) after a's 4, 3: queue [7, 0, 4, 3, 1, 2, 6, 5]
    x = req("x", list(range(500, 516)))  # an unrelated request evicts the four oldest: 7, 0, 4, 3
    hits, n = kv.get_computed_blocks(x)
    assert n == 0 and kv.allocate_slots(x, 16, hits) is not None
    assert kv.block_ids("x")[WINDOW] == [7, 0, 4, 3]
    c = req("c", list(range(20)) + [99])
    hits, n = kv.get_computed_blocks(c)
    # The full pool still caches all 5 of a's blocks, but h = 5 needs window 3, 4 and h = 4 needs 2, 3:
    # evicted. h = 3 needs 1, 2: cached. So the hit is shortened to 12 tokens.
    assert n == 12 and ids(hits.blocks[FULL]) == [0, 1, 2]
    assert ids(hits.blocks[WINDOW]) == [None, 1, 2]
    kv.free(x)
    assert kv.allocate_slots(c, c.num_tokens - n, hits) is not None
    assert kv.block_ids("c")[FULL][:3] == [0, 1, 2] and kv.block_ids("c")[WINDOW][:3] == [NULL_BLOCK, 1, 2]
    kv.free(c)
    assert all_free(kv)


def test_lookahead_slots_never_make_a_block_full_for_the_prefix_cache():
    """A drafter's lookahead slots are allocated but not written by the step's forward: a prompt chunk ending 2
    tokens short of a block boundary, with 2 lookahead slots, must not register that block (a preempted or aborted
    request would leave its last rows unwritten, and a later hit would read them)."""
    kv = hybrid(16, 16)
    prompt = list(range(1, 12))
    a = req("a", prompt)
    assert kv.allocate_slots(a, 2, num_lookahead_tokens=2) is not None  # rows 0, 1 written; 2, 3 are lookahead
    assert [len(t) for t in kv.block_ids("a")] == [1, 1]  # the lookahead slots are held
    a.num_computed_tokens = 2
    kv.free(a)
    assert kv.get_computed_blocks(req("b", prompt))[1] == 0
    c = req("c", prompt)
    assert kv.allocate_slots(c, 4, num_lookahead_tokens=2) is not None  # rows 0..3 written: block 0 is full
    c.num_computed_tokens = 4
    kv.free(c)
    assert kv.get_computed_blocks(req("d", prompt))[1] == BS

def test_no_window_blocks_means_no_admission():
    kv = hybrid(32, 2)
    a = req("a", list(range(12)))  # 3 blocks at once: the full pool has them, the window pool does not
    assert kv.allocate_slots(a, 12) is None
    assert all_free(kv) and kv.groups[FULL].pool.num_free_blocks == 32


def test_scheduler_preempts_on_window_shortage_and_window_use_stays_bounded():
    """Decode-heavy run on a window pool too small for three sequences at once (a decode here holds up to 3
    window blocks): the scheduler preempts, every sequence finishes, each holds at most ceil(lookback/bs) + 2
    window blocks while it decodes, and every block of both pools comes back."""
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8)
    per_seq = sliding_blocks_per_seq(LOOKBACK, BS, 1)
    assert per_seq == 4 and min_sliding_blocks(LOOKBACK, BS, 3, 8) == 14
    kv = hybrid(64, 6)
    s = Scheduler(cfg, kv)
    reqs = [req(r, [100 * i + j for j in range(6)], max_tokens=40) for i, r in enumerate("abc")]
    for r in reqs:
        s.add_request(r)
    steps = 0
    while s.num_unfinished:
        out = s.schedule()
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            full, window = kv.block_ids(rid)
            assert len(window) == len(full)
            if n == 1:
                assert kv.groups[WINDOW].num_held(rid) <= per_seq
            running = s.requests[rid]
            if running.num_computed_tokens + n == running.num_tokens:
                sampled[rid] = [SampledToken(7)]
        s.update_from_output(out, ModelRunnerOutput(sampled))
        steps += 1
        assert steps < 1000
    assert all(r.num_output_tokens == 40 for r in reqs)
    assert s.num_preemptions > 0
    assert all_free(kv)


def test_coarse_group_one_block_per_span_keyed_by_its_last_ordinary_block():
    """Coarse blocks span 2 ordinary blocks (8 tokens): block k is cached under the key of ordinary block
    2k + 1, and a hit of h ordinary blocks also needs coarse blocks 0 .. h*4 // 8 - 1."""
    kv = hybrid(32, 16, num_coarse_blocks=4, coarse_block_tokens=8)
    a = req("a", list(range(22)))  # 6 ordinary blocks (5 full), 3 coarse blocks (2 complete)
    schedule_all(kv, a)
    assert kv.block_ids("a")[FULL] == [0, 1, 2, 3, 4, 5] and kv.block_ids("a")[COARSE] == [0, 1, 2]
    keys = kv._block_keys(a, 5)
    assert kv.groups[COARSE].pool.get_cached_block(keys[1]).block_id == 0
    assert kv.groups[COARSE].pool.get_cached_block(keys[3]).block_id == 1
    assert kv.groups[COARSE].pool.blocks[2].key is None  # its span is not complete: never shared
    b = req("b", list(range(20)) + [77, 78])
    hits, n = kv.get_computed_blocks(b)  # 5 ordinary blocks -> coarse blocks 0, 1 (20 // 8 = 2)
    assert n == 20 and ids(hits.blocks[COARSE]) == [0, 1]
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is not None
    assert kv.block_ids("b")[COARSE] == [0, 1, 3]
    # The coarse pool is now exhausted (4 blocks): a new request needing one cannot be admitted.
    c = req("c", list(range(300, 305)))
    assert kv.get_computed_blocks(c)[1] == 0 and kv.allocate_slots(c, 5) is None
    kv.free(a), kv.free(b)
    # Evict coarse block 1 (a's second span, tokens 8..15): a later hit may not cover token 15, where that
    # entry is written, so it stops at 3 ordinary blocks (12 tokens; the window pool has blocks 1, 2).
    kv.groups[COARSE].pool._evict(kv.groups[COARSE].pool.blocks[1])
    hits, n = kv.get_computed_blocks(req("d", list(range(22))))
    assert n == 12 and ids(hits.blocks[COARSE]) == [0] and len(hits.blocks[FULL]) == 3
    assert all(p.num_free_blocks == p.num_blocks for p in kv.pools) and not kv.groups[COARSE].tables
