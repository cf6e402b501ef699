"""KV memory planning per group: one whole-life group takes the budget; a sliding group gets the running batch's
need plus headroom (capped at the whole-life pool's count) and the whole-life groups the rest; a budget that
cannot hold one max_model_len request is refused at start-up."""
from __future__ import annotations

import pytest

from openinfer.engine.kv_plan import plan_kv_blocks as _plan
from openinfer.kv_cache_interface import KVBudget, KVGroupSpec, kv_startup_message, min_sliding_blocks

FULL, WINDOW, COARSE = "full", "window", "coarse"
HYBRID = [KVGroupSpec(FULL, 100), KVGroupSpec(WINDOW, 1000, lookback_tokens=15)]


def plan_kv_blocks(groups, block_size=8, budget_bytes=None, num_kv_blocks=None, cap_to_useful=False):
    budget = KVBudget(budget_bytes, cap_to_useful) if budget_bytes is not None else None
    return _plan(groups, block_size=block_size, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                 budget=budget, num_kv_blocks=num_kv_blocks)


def test_dense_is_one_group_sized_as_before():
    plan = plan_kv_blocks([KVGroupSpec(FULL, 100)], budget_bytes=100_000)
    assert plan == {FULL: 1000}
    assert plan_kv_blocks([KVGroupSpec(FULL, 100)], block_size=16, num_kv_blocks=12) == {FULL: 12}
    # A share of free host memory is capped at twice what 4 requests of 64 tokens can use (4 x 8 blocks).
    assert plan_kv_blocks([KVGroupSpec(FULL, 100)], budget_bytes=100_000, cap_to_useful=True) == {FULL: 64}
    with pytest.raises(ValueError, match="fewer than 2 blocks"):
        plan_kv_blocks([KVGroupSpec(FULL, 100)], budget_bytes=150)


def test_window_pool_gets_the_batch_need_plus_headroom_and_the_full_group_the_rest():
    # Running batch: 4 sequences x (ceil(15/8) + 2) + ceil(16/8) = 18 blocks; +25% -> 23.
    assert min_sliding_blocks(15, 8, 4, 16) == 18
    plan = plan_kv_blocks(HYBRID, budget_bytes=1_000_000)
    assert plan == {WINDOW: 23, FULL: (1_000_000 - 23 * 1000) // 100}
    # A budget too small for that splits evenly by count (the window pool is never larger than the full one).
    plan = plan_kv_blocks(HYBRID, budget_bytes=20_000)
    assert plan == {WINDOW: 18, FULL: 18}
    # An explicit block count sets the full group; the window pool follows, at least one sequence's need.
    assert plan_kv_blocks(HYBRID, num_kv_blocks=12) == {FULL: 12, WINDOW: 12}
    assert plan_kv_blocks(HYBRID, num_kv_blocks=2) == {FULL: 2, WINDOW: 5}


def test_budget_below_one_request_is_refused():
    # 64 tokens need 8 full blocks; 5000 B only holds 4 of each.
    with pytest.raises(ValueError, match="cannot hold one 64-token request"):
        plan_kv_blocks(HYBRID, budget_bytes=5_000)


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
    assert plan_kv_blocks(groups, num_kv_blocks=12)[COARSE] == 10
    plan = plan_kv_blocks(groups, budget_bytes=1_000_000)
    assert plan == {WINDOW: 23, FULL: 7814, COARSE: 3907 + 4}
    assert 23 * 1000 + 7814 * 100 + 3911 * 50 <= 1_000_000 < 23 * 1000 + 7815 * 100 + 3912 * 50
