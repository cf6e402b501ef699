"""Expert-parallel MoE: each rank of the expert-parallel group holds a contiguous range of the routed experts, and
every (token, expert) pair is computed on the rank that holds the expert.

Per MoE layer: pairs are sorted by expert id (which groups them by owner rank), counts are exchanged, the token
rows travel to their owners with one ``all_to_all_single`` (uneven splits), each owner runs its experts on what it
received (grouped by local expert), the results travel back the same way, and the combine (weights, then the sum
per token) runs where the tokens live - exactly as one process combines them, in the same pair order. Shared
experts and routing stay on every rank (replicated); only the routed experts are split.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from openinfer.distributed.parallel_state import GroupCoordinator


def all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int],
               group: GroupCoordinator) -> torch.Tensor:
    """Rows ``x`` (grouped by destination, ``send_counts[r]`` rows for rank r) -> the rows every rank sent here
    (``recv_counts[r]`` from rank r, in rank order)."""
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts,
                           group=group.device_group)
    return out


def expert_parallel_experts(x: torch.Tensor, topk_ids: torch.Tensor, experts_per_rank: int,
                            group: GroupCoordinator,
                            run_local: Callable[[torch.Tensor, list[int]], torch.Tensor]
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], topk_ids [T, K] (global expert ids) -> (y [T*K, H], order): the expert output of every pair, in
    ``order`` (the pairs sorted by expert id, stable), ready for the combine. ``run_local(rows, counts)`` runs this
    rank's experts on rows grouped by local expert."""
    k = topk_ids.shape[1]
    ep, me = group.world_size, group.rank_in_group
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    rows = x.index_select(0, order // k)
    send = torch.bincount(torch.div(sorted_ids, experts_per_rank, rounding_mode="floor"), minlength=ep)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group.device_group)
    send_counts, recv_counts = send.tolist(), recv.tolist()
    recv_rows = all_to_all(rows, send_counts, recv_counts, group)
    local_ids = all_to_all(sorted_ids, send_counts, recv_counts, group) - me * experts_per_rank
    # Rows arrive grouped by sender; group them by local expert for the matmuls, then put them back.
    by_expert = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids, minlength=experts_per_rank).tolist()
    y_local = torch.empty_like(recv_rows)
    y_local[by_expert] = run_local(recv_rows.index_select(0, by_expert), counts).to(recv_rows.dtype)
    return all_to_all(y_local, recv_counts, send_counts, group), order
