"""KV memory planning per group: one full group as before; with a window group, the window pool gets the running
batch's need plus headroom (capped at the full pool's count) and the full group the rest; a budget that cannot
hold one max_model_len request is refused at start-up."""
from __future__ import annotations

import pytest
import torch

from openinfer.config import CacheConfig, SchedulerConfig
from openinfer.engine.kv_groups import COARSE, FULL, WINDOW, KVGroupSpec, kv_startup_message, min_window_blocks
from openinfer.executor.kv_sizing import plan_kv_blocks

CPU = torch.device("cpu")
SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16)
MAX_LEN = 64
HYBRID = [KVGroupSpec(FULL, 100), KVGroupSpec(WINDOW, 1000, lookback_tokens=15)]


def plan_for(cache: CacheConfig, groups: list[KVGroupSpec]) -> dict[str, int]:
    return plan_kv_blocks(cache, SCHED, MAX_LEN, CPU, groups)


def _gb(n_bytes: int) -> float:
    return n_bytes / (1 << 30)


def test_dense_is_one_group_sized_as_before():
    plan = plan_for(CacheConfig(block_size=8, kv_cache_memory_gb=_gb(100_000)), [KVGroupSpec(FULL, 100)])
    assert plan == {FULL: 1000}
    assert plan_for(CacheConfig(num_kv_blocks=12), [KVGroupSpec(FULL, 100)]) == {FULL: 12}


def test_window_pool_gets_the_batch_need_plus_headroom_and_the_full_group_the_rest():
    # Running batch: 4 sequences x (ceil(15/8) + 2) + ceil(16/8) = 18 blocks; +25% -> 23.
    assert min_window_blocks(15, 8, 4, 16) == 18
    plan = plan_for(CacheConfig(block_size=8, kv_cache_memory_gb=_gb(1_000_000)), HYBRID)
    assert plan == {WINDOW: 23, FULL: (1_000_000 - 23 * 1000) // 100}
    # A budget too small for that splits evenly by count (the window pool is never larger than the full one).
    plan = plan_for(CacheConfig(block_size=8, kv_cache_memory_gb=_gb(20_000)), HYBRID)
    assert plan == {WINDOW: 18, FULL: 18}
    # An explicit block count sets the full group; the window pool follows, at least one sequence's need.
    assert plan_for(CacheConfig(block_size=8, num_kv_blocks=12), HYBRID) == {FULL: 12, WINDOW: 12}
    assert plan_for(CacheConfig(block_size=8, num_kv_blocks=2), HYBRID) == {FULL: 2, WINDOW: 5}


def test_budget_below_one_request_is_refused():
    # 64 tokens need 8 full blocks; 5000 B only holds 4 of each.
    with pytest.raises(ValueError, match="cannot hold one 64-token request"):
        plan_for(CacheConfig(block_size=8, kv_cache_memory_gb=_gb(5_000)), HYBRID)


def test_startup_message_reports_bytes_per_token_for_every_model():
    dense = kv_startup_message([KVGroupSpec(FULL, 1600)], {FULL: 10}, 16, 80)
    assert dense == "KV cache: 160 tokens (10 blocks of 16, 100 bytes/token); max concurrency 2.00x at 80 tokens " \
                    "per request"
    hybrid = kv_startup_message(HYBRID, {FULL: 10, WINDOW: 23}, 8, 40)
    assert hybrid == ("KV cache: 80 tokens (10 blocks of 8 + 23 window blocks, 13 bytes/token steady state + "
                      "window group 125 bytes/token over a 15-token lookback = 4000 bytes per running sequence); "
                      "max concurrency 2.00x at 40 tokens per request")


def test_coarse_group_follows_the_full_group():
    groups = HYBRID + [KVGroupSpec(COARSE, 50, block_tokens=16)]  # one coarse block per 2 full blocks
    # ceil(12 / 2) + one partial coarse block per running sequence (4).
    assert plan_for(CacheConfig(block_size=8, num_kv_blocks=12), groups)[COARSE] == 10
    plan = plan_for(CacheConfig(block_size=8, kv_cache_memory_gb=_gb(1_000_000)), groups)
    assert plan == {WINDOW: 23, FULL: 7814, COARSE: 3907 + 4}
    assert 23 * 1000 + 7814 * 100 + 3911 * 50 <= 1_000_000 < 23 * 1000 + 7815 * 100 + 3912 * 50
