"""What a model's KV cache is made of, as the block manager and the memory sizing see it. Pure Python.

A model declares one ``KVGroupSpec`` per group of stores that share a block table (``kv_cache_spec``). Dense
models have one group, ``full``: every token's KV is read for the whole sequence life. DeepSeek-V4 adds a
``window`` group: token-level state that is only ever read within ``lookback_tokens`` positions before the
query, so the block manager may release a sequence's window blocks that lie wholly behind that lookback
(vLLM v1's hybrid allocator / ``SlidingWindowManager``). Both groups use the same block size and the same
logical block index per token, so one chain of prefix hashes serves both. It may add a ``coarse`` group:
full-life state with one row per ``block_tokens`` tokens (a multiple of the block size; V4's heavily compressed
entries, one per 128 tokens), whose block k is hashed with the key of the last ordinary block it spans. Without
it, such state would take a whole entry slot in every ordinary block.
"""
from __future__ import annotations

from dataclasses import dataclass

FULL = "full"
WINDOW = "window"
COARSE = "coarse"


@dataclass(frozen=True)
class KVGroupSpec:
    name: str  # FULL, WINDOW or COARSE
    bytes_per_block: int  # across every layer's stores of this group
    # WINDOW only: a query at position p reads this group's rows at positions >= p - lookback_tokens.
    lookback_tokens: int | None = None
    # COARSE only: tokens one block spans (a multiple of the engine's block size).
    block_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.name not in (FULL, WINDOW, COARSE):
            raise ValueError(f"unknown KV group {self.name!r}")
        if (self.name == WINDOW) != (self.lookback_tokens is not None):
            raise ValueError("lookback_tokens is set for the window group and only for it")
        if (self.name == COARSE) != (self.block_tokens is not None):
            raise ValueError("block_tokens is set for the coarse group and only for it")


def coarse_blocks_for(num_full_blocks: int, block_size: int, block_tokens: int, max_num_seqs: int) -> int:
    """Coarse blocks that never run out before the full group does: one per block_tokens / block_size full
    blocks, plus the partially filled one at the end of each running sequence."""
    per = block_tokens // block_size
    return -(-num_full_blocks // per) + max_num_seqs


def window_blocks_per_seq(lookback_tokens: int, block_size: int, num_new_tokens: int) -> int:
    """Most window blocks one sequence holds while it computes ``num_new_tokens`` tokens from position c:
    blocks floor((c - lookback) / bs) .. ceil((c + n) / bs) - 1, i.e. at most
    ceil(lookback / bs) + ceil(n / bs) + 1 (the lookback start and the new tokens each straddle a block edge)."""
    return -(-lookback_tokens // block_size) + -(-num_new_tokens // block_size) + 1


def min_window_blocks(lookback_tokens: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Window blocks that let a full running batch make progress. Summing ``window_blocks_per_seq`` over the
    running sequences, with sum(n_i) <= max_num_batched_tokens and sum(ceil(n_i / bs)) < sum(n_i) / bs + S:
    max_num_seqs * (ceil(lookback / bs) + 2) + ceil(max_num_batched_tokens / bs)."""
    return max_num_seqs * (-(-lookback_tokens // block_size) + 2) + -(-max_num_batched_tokens // block_size)


def group(groups: list[KVGroupSpec], name: str) -> KVGroupSpec | None:
    return next((g for g in groups if g.name == name), None)


def bytes_per_token(groups: list[KVGroupSpec], block_size: int) -> int:
    """What every token of a sequence holds for the sequence's whole life: the full group's bytes per token,
    plus the coarse group's (one block per block_tokens tokens)."""
    full = group(groups, FULL).bytes_per_block
    coarse = group(groups, COARSE)
    if coarse is None:
        return -(-full // block_size)
    num = full * coarse.block_tokens + coarse.bytes_per_block * block_size
    return -(-num // (block_size * coarse.block_tokens))


def window_bytes_per_seq(win: KVGroupSpec, block_size: int) -> int:
    """What one decoding sequence holds in the window group: its lookback plus the straddling blocks."""
    return window_blocks_per_seq(win.lookback_tokens, block_size, 1) * win.bytes_per_block


def kv_bytes_summary(groups: list[KVGroupSpec], block_size: int) -> str:
    msg = f"{bytes_per_token(groups, block_size)} bytes/token"
    win = group(groups, WINDOW)
    if win is not None:
        msg += (f" steady state + window group {win.bytes_per_block // block_size} bytes/token over a "
                f"{win.lookback_tokens}-token lookback = {window_bytes_per_seq(win, block_size)} bytes per "
                f"running sequence")
    return msg


def kv_startup_message(groups: list[KVGroupSpec], blocks: dict[str, int], block_size: int,
                       max_model_len: int) -> str:
    n = blocks[FULL]
    tokens = n * block_size
    pools = f"{n} blocks of {block_size}"
    if WINDOW in blocks:
        pools += f" + {blocks[WINDOW]} window blocks"
    if COARSE in blocks:
        pools += f" + {blocks[COARSE]} coarse blocks of {group(groups, COARSE).block_tokens}"
    return (f"KV cache: {tokens} tokens ({pools}, {kv_bytes_summary(groups, block_size)}); "
            f"max concurrency {tokens / max_model_len:.2f}x at {max_model_len} tokens per request")
