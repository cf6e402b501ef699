"""How many blocks each KV group gets, from the groups' specs and a memory budget. Pure Python.

Whole-life groups scale together with one token capacity N (a group of r-token blocks gets ceil(N / r) blocks,
plus one partly filled block per running sequence when r is larger than the engine's block size). Sliding groups
get what a full running batch needs (``min_sliding_blocks``) plus ``SLIDING_HEADROOM_PCT`` for released blocks
that stay cached for prefix hits - but never more than the whole-life equivalent of N, since a sequence never
holds more sliding blocks than that. N is the largest capacity whose blocks fit the budget; ``num_kv_blocks``
fixes N at that many engine blocks instead.
"""
from __future__ import annotations

from openinfer.kv_cache_interface import (KVBudget, KVGroupSpec, blocks_for_tokens, check_groups,
                                          min_sliding_blocks, sliding_blocks_per_seq)

# Sliding-group blocks beyond what a full running batch needs, in percent of that need: released blocks stay
# hashed in the pool and let later requests hit a prefix that ends where they lie.
SLIDING_HEADROOM_PCT = 25


def plan_kv_blocks(groups: list[KVGroupSpec], *, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                   max_model_len: int, budget: KVBudget | None = None,
                   num_kv_blocks: int | None = None) -> dict[str, int]:
    """Blocks per group name. Either ``num_kv_blocks`` (engine blocks of whole-life capacity) or ``budget``."""
    check_groups(groups, block_size)
    bs = block_size
    life = [g for g in groups if not g.sliding]
    sliding = [g for g in groups if g.sliding]
    chunk = min(max_num_batched_tokens, max_model_len)

    def wanted(g: KVGroupSpec) -> int:
        need = min_sliding_blocks(g.lookback_tokens, g.tokens_per_block(bs), max_num_seqs, max_num_batched_tokens)
        return -(-need * (100 + SLIDING_HEADROOM_PCT) // 100)

    def one_seq(g: KVGroupSpec) -> int:
        return sliding_blocks_per_seq(g.lookback_tokens, g.tokens_per_block(bs), chunk)

    def counts(num_tokens: int) -> dict[str, int]:
        out = {}
        for g in groups:
            r = g.tokens_per_block(bs)
            if g.sliding:
                out[g.name] = min(wanted(g), blocks_for_tokens(num_tokens, r))
            else:
                out[g.name] = blocks_for_tokens(num_tokens, r) + (max_num_seqs if r > bs else 0)
        return out

    def cost(num_tokens: int) -> int:
        c = counts(num_tokens)
        return sum(c[g.name] * g.bytes_per_block for g in groups)

    if num_kv_blocks is not None:
        plan = counts(num_kv_blocks * bs)
        for g in sliding:  # the user fixed the whole-life size; a sliding pool still runs one sequence
            plan[g.name] = max(one_seq(g), plan[g.name])
        return plan
    if budget is None:
        raise ValueError("plan_kv_blocks needs a memory budget or num_kv_blocks")
    limit = budget.num_bytes
    if budget.cap_to_useful:
        limit = min(limit, 2 * cost(max_num_seqs * blocks_for_tokens(max_model_len, bs) * bs))
    n = _largest_fit(cost, limit, bs)
    plan = counts(n * bs)
    if sliding:
        need = blocks_for_tokens(max_model_len, bs) * bs
        if n * bs < need or any(plan[g.name] < one_seq(g) for g in sliding):
            wants = ", ".join(f"{blocks_for_tokens(need, g.tokens_per_block(bs)) if not g.sliding else one_seq(g)} "
                              f"{g.name}-group blocks of {g.bytes_per_block} B" for g in groups)
            got = ", ".join(f"{plan[g.name]}" for g in groups)
            raise ValueError(
                f"KV cache budget of {limit / 2**20:.1f} MiB cannot hold one {max_model_len}-token request: it "
                f"needs {wants} (got {got}); raise kv_cache_memory_gb or lower max_model_len / "
                f"max_num_batched_tokens")
    elif n < 2:
        per_block = sum(g.bytes_per_block for g in life)
        raise ValueError(f"KV cache budget of {limit / 2**20:.1f} MiB holds fewer than 2 blocks of "
                         f"{per_block} bytes; raise kv_cache_memory_gb")
    return plan


def _largest_fit(cost, limit: int, block_size: int) -> int:
    """Largest n >= 0 with cost(n * block_size) <= limit (cost grows with n): doubling, then bisection."""
    if cost(block_size) > limit:
        return 0
    lo, hi = 1, 2
    while cost(hi * block_size) <= limit:
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            raise ValueError("KV groups declare no bytes per block: the cache size is unbounded")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cost(mid * block_size) <= limit:
            lo = mid
        else:
            hi = mid
    return lo
