"""What a model's KV cache is made of, as the block manager, the memory planner and the runner see it. Pure Python.

A model declares its cache as a list of ``KVGroupSpec`` (``kv_cache_spec``): each group is a set of stores that
share one block table per sequence. A group is data, not a name the engine knows: it is described by two policy
parameters, and the engine applies the policy without knowing what the group holds.

- ``block_tokens``: how many token positions one block spans (``None``: the engine's block size). Larger blocks
  (a multiple of the block size) suit state with one row per many tokens, e.g. DeepSeek-V4's entries compressed
  128:1 - in ordinary blocks they would take a whole entry slot in every block.
- ``lookback_tokens``: ``None`` means every row is read for the sequence's whole life (full attention). A number
  means a query at position p only reads rows at positions >= p - lookback_tokens (sliding-window attention and
  other short-lived state), so the block manager may release a running sequence's blocks that lie wholly behind
  that lookback, and a prefix hit only needs the blocks the first recomputed query reads.

Dense models have one group; DeepSeek-V3 one (its latent cache); DeepSeek-V4 three (entries for the whole life,
token-level rows read within a 127-token lookback, and 128-token coarse blocks). Every group's block k covers the
same tokens in every sequence that shares the prefix, so one chain of prefix hashes serves all groups: a group
block spanning c ordinary blocks is keyed by the hash of the last ordinary block it covers.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class KVGroupSpec:
    name: str  # the model's own name for the group; keys block counts and per-step tables
    bytes_per_block: int  # across every layer's stores in this group
    block_tokens: int | None = None  # token positions one block spans; None = the engine's block size
    lookback_tokens: int | None = None  # None = read for the whole life; else rows >= p - lookback are read

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"KV group name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.bytes_per_block, int) or self.bytes_per_block < 0:
            raise ValueError(f"KV group {self.name!r}: bytes_per_block must be an int >= 0, "
                             f"got {self.bytes_per_block!r}")
        if self.block_tokens is not None and self.block_tokens <= 0:
            raise ValueError(f"KV group {self.name!r}: block_tokens must be > 0, got {self.block_tokens}")
        if self.lookback_tokens is not None and self.lookback_tokens < 0:
            raise ValueError(f"KV group {self.name!r}: lookback_tokens must be >= 0, got {self.lookback_tokens}")

    @property
    def sliding(self) -> bool:
        return self.lookback_tokens is not None

    def tokens_per_block(self, block_size: int) -> int:
        return self.block_tokens or block_size

    def check(self, block_size: int) -> None:
        """Raise unless this group's blocks are a whole number of the engine's blocks (shared hash chain)."""
        r = self.tokens_per_block(block_size)
        if r % block_size:
            raise ValueError(f"KV group {self.name!r}: blocks of {r} tokens are not a whole number of "
                             f"{block_size}-token blocks")


def check_groups(groups: list[KVGroupSpec], block_size: int) -> None:
    if not groups:
        raise ValueError("a model must declare at least one KV group")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"KV group names must be unique, got {names}")
    for g in groups:
        g.check(block_size)


def blocks_for_tokens(num_tokens: int, tokens_per_block: int) -> int:
    return -(-num_tokens // tokens_per_block)


def sliding_blocks_per_seq(lookback_tokens: int, tokens_per_block: int, num_new_tokens: int) -> int:
    """Most blocks of a sliding group one sequence holds while it computes ``num_new_tokens`` tokens from position
    c: blocks floor((c - lookback) / r) .. ceil((c + n) / r) - 1, i.e. at most ceil(lookback / r) + ceil(n / r) + 1
    (the lookback start and the new tokens each straddle a block edge)."""
    r = tokens_per_block
    return -(-lookback_tokens // r) + -(-num_new_tokens // r) + 1


def min_sliding_blocks(lookback_tokens: int, tokens_per_block: int, max_num_seqs: int,
                       max_num_batched_tokens: int) -> int:
    """Blocks of a sliding group that let a full running batch make progress. Summing ``sliding_blocks_per_seq``
    over the running sequences, with sum(n_i) <= max_num_batched_tokens and sum(ceil(n_i / r)) < sum(n_i) / r + S:
    max_num_seqs * (ceil(lookback / r) + 2) + ceil(max_num_batched_tokens / r)."""
    r = tokens_per_block
    return max_num_seqs * (-(-lookback_tokens // r) + 2) + -(-max_num_batched_tokens // r)


def bytes_per_token(groups: list[KVGroupSpec], block_size: int) -> int:
    """What every token of a sequence holds for the sequence's whole life: the whole-life groups' bytes per
    token, summed exactly and rounded up once."""
    total = sum((Fraction(g.bytes_per_block, g.tokens_per_block(block_size)) for g in groups if not g.sliding),
                Fraction(0))
    return -(-total.numerator // total.denominator)


def sliding_bytes_per_seq(group: KVGroupSpec, block_size: int) -> int:
    """What one decoding sequence holds in a sliding group: its lookback plus the straddling blocks."""
    r = group.tokens_per_block(block_size)
    return sliding_blocks_per_seq(group.lookback_tokens, r, 1) * group.bytes_per_block


def kv_bytes_summary(groups: list[KVGroupSpec], block_size: int) -> str:
    msg = f"{bytes_per_token(groups, block_size)} bytes/token"
    sliding = [g for g in groups if g.sliding]
    if sliding:
        msg += " steady state"
    for g in sliding:
        r = g.tokens_per_block(block_size)
        msg += (f" + {g.name} group {g.bytes_per_block // r} bytes/token over a {g.lookback_tokens}-token lookback "
                f"= {sliding_bytes_per_seq(g, block_size)} bytes per running sequence")
    return msg


def token_capacity(groups: list[KVGroupSpec], num_blocks: dict[str, int], block_size: int) -> int:
    """Tokens the cache holds for whole sequence lives: the tightest whole-life group (every token in a block of
    each); a model with sliding groups only is bounded by its largest pool."""
    life = [g for g in groups if not g.sliding] or groups
    return min(num_blocks[g.name] * g.tokens_per_block(block_size) for g in life)


def kv_startup_message(groups: list[KVGroupSpec], num_blocks: dict[str, int], block_size: int,
                       max_model_len: int) -> str:
    tokens = token_capacity(groups, num_blocks, block_size)
    # The first whole-life group of ordinary blocks is "the" cache; the others are named.
    main = next((g for g in groups if not g.sliding and g.tokens_per_block(block_size) == block_size), groups[0])
    parts = [f"{num_blocks[main.name]} blocks of {main.tokens_per_block(block_size)}"]
    for g in groups:
        if g is main:
            continue
        r = g.tokens_per_block(block_size)
        parts.append(f"{num_blocks[g.name]} {g.name} blocks" + (f" of {r}" if r != block_size else ""))
    return (f"KV cache: {tokens} tokens ({' + '.join(parts)}, {kv_bytes_summary(groups, block_size)}); "
            f"max concurrency {tokens / max_model_len:.2f}x at {max_model_len} tokens per request")


@dataclass(frozen=True)
class KVBudget:
    """Memory a worker can give the KV cache (measured after its warm-up, or the user's explicit figure).
    ``cap_to_useful``: the figure is a share of free host memory, so the planner caps the cache at twice what
    ``max_num_seqs`` full-length requests can ever hold (zeroing gigabytes of RAM nobody uses only slows
    start-up); an explicit budget or a GPU's memory is taken as it is."""

    num_bytes: int
    cap_to_useful: bool = False
