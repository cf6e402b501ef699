"""Which bytes of which rank go where when the prefill and decode instances run different tensor_parallel_size
(vLLM's NIXL connector's heterogeneous TP). Pure Python: addresses only, no NIXL.

A KV store is either whole on every rank (``rows == 0``: DeepSeek's latent caches, computed whole on every rank)
or split by KV heads (``rows > 0``: ``Attention``'s ``[block, token, kv head, head dim]`` cache - each of a block's
``rows`` token rows holds the rank's slice of the heads, and the ranks' slices in rank order make the full row).
With ``P`` producer ranks and ``D`` decoder ranks (one size dividing the other), decoder rank ``i`` owns bytes
``[i, i + 1) * R / D`` of every full row ``R`` and takes them from the producer ranks whose slices overlap them:
several producer ranks (P > D: it gathers their halves) or a part of one (P < D: it takes its slice of a wider
row). A store that is whole everywhere comes from one producer rank, ``i mod P``. Every producer rank hears from
the decoder ranks it serves (or, for whole stores no decoder rank reads from it, from rank ``r mod D``): a held
prompt is freed once each of them said it is done.
"""
from __future__ import annotations

from typing import Protocol


class Store(Protocol):  # side_channel.StoreLayout (not imported: this module is the lower one)
    base_addr: int
    block_bytes: int
    num_blocks: int
    rows: int


def size_mismatch(p: int, d: int) -> str:
    """Why P producer ranks cannot serve D decoder ranks ("" when they can)."""
    if max(p, d) % min(p, d):
        return (f"the prefill instance's tensor_parallel_size={p} and this instance's tensor_parallel_size={d}: one "
                "must divide the other")
    return ""


def sources(p: int, d: int, i: int, split: bool) -> list[int]:
    """The producer ranks decoder rank ``i`` takes bytes from."""
    if p == d:
        return [i]
    if not split:
        return [i % p]
    return list(range(i * p // d, (i + 1) * p // d)) if p > d else [i * p // d]


def answers_for(p: int, d: int, i: int, split: bool) -> list[int]:
    """The producer ranks decoder rank ``i`` tells (pull: a completion notice) or registers with (push): those it
    takes bytes from, and - whole stores, more producer ranks than decoder ranks - those nobody reads, r mod D = i."""
    own = sources(p, d, i, split)
    extra = [] if split or p <= d else [r for r in range(p) if r % d == i]
    return sorted({*own, *extra})


def notices_per_rank(p: int, d: int) -> int:
    """How many decoder ranks answer for each producer rank."""
    return max(1, d // p)


def stores_fit(src: list[list[Store]], src_size: int, dst: list[list[Store]], dst_size: int) -> bool:
    """Both sides hold the same KV, sharded their way: the same groups and stores, a whole store the same bytes per
    block, a split store the same rows and full-row bytes (its heads divide over both sizes)."""
    if len(src) != len(dst) or any(len(a) != len(b) for a, b in zip(src, dst)):
        return False
    for a_stores, b_stores in zip(src, dst):
        for a, b in zip(a_stores, b_stores):
            if a.rows != b.rows:
                return False
            if a.rows == 0 and a.block_bytes != b.block_bytes:
                return False
            if a.rows and (a.block_bytes % a.rows or b.block_bytes % b.rows
                           or a.block_bytes * src_size != b.block_bytes * dst_size):
                return False
    return True


def transfer_descs(src_ids: list[list[int]], dst_ids: list[list[int]], src: list[list[Store]], src_rank: int,
                   src_size: int, dst: list[list[Store]], dst_rank: int, dst_size: int
                   ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(address, bytes, device) pairs moving what producer rank ``src_rank`` (of ``src_size``) holds of decoder rank
    ``dst_rank``'s (of ``dst_size``) share of every (group, store, block) both sides name (-1 on either: skipped).
    Whole blocks where the slices coincide; otherwise one descriptor per token row."""
    split = any(s.rows for stores in dst for s in stores)
    whole_from = sources(src_size, dst_size, dst_rank, split)[0]
    src_d: list[tuple[int, int, int]] = []
    dst_d: list[tuple[int, int, int]] = []
    for s_ids, d_ids, s_stores, d_stores in zip(src_ids, dst_ids, src, dst):
        if len(s_ids) != len(d_ids):
            raise RuntimeError(f"block lists differ in length ({len(s_ids)} vs {len(d_ids)})")
        for s, d in zip(s_stores, d_stores):
            if s.rows:
                sr, dr = s.block_bytes // s.rows, d.block_bytes // d.rows
                lo, hi = max(src_rank * sr, dst_rank * dr), min((src_rank + 1) * sr, (dst_rank + 1) * dr)
                if lo >= hi:
                    continue
                whole = sr == dr == hi - lo
                s_off, d_off = lo - src_rank * sr, lo - dst_rank * dr
            elif src_rank != whole_from:
                continue
            else:
                whole = True
            for a, b in zip(s_ids, d_ids):
                if a < 0 or b < 0:
                    continue
                if a >= s.num_blocks or b >= d.num_blocks:
                    raise RuntimeError(f"block id out of range ({a}, {b})")
                sa, da = s.base_addr + a * s.block_bytes, d.base_addr + b * d.block_bytes
                if whole:
                    src_d.append((sa, s.block_bytes, 0))
                    dst_d.append((da, d.block_bytes, 0))
                    continue
                for t in range(s.rows):
                    src_d.append((sa + t * sr + s_off, hi - lo, 0))
                    dst_d.append((da + t * dr + d_off, hi - lo, 0))
    return src_d, dst_d
