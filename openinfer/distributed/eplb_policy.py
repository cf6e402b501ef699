"""Expert placement for expert-parallel MoE: which logical expert each physical expert slot holds (DeepSeek's EPLB
policy, written from its published description).

Given each MoE layer's recent load per logical expert, place ``num_physical`` expert slots (the logical experts
plus ``num_physical - num_logical`` redundant replicas) on ``num_ranks`` ranks, ``num_physical / num_ranks`` slots
each, so the busiest rank is as little busy as possible:
- ``replicate``: give the extra slots, one at a time, to the expert whose load per replica is highest;
- ``balanced_packing``: place items (heaviest first) on the least loaded bin that still has room.
Hierarchical (when expert groups divide evenly over nodes): expert groups are first packed onto nodes, replicas are
made within each node, then the node's slots are packed onto its ranks - so a token's group-limited routing stays
within few nodes. Global otherwise: replicate over all experts, pack over all ranks. Pure torch on CPU, no
collectives: every rank computes the same placement from the same (all-reduced) loads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Placement:
    phy_to_log: torch.Tensor  # [layers, num_physical] int64: the logical expert each slot holds
    log_count: torch.Tensor  # [layers, num_logical] int64: replicas per logical expert (>= 1)
    log_to_phy: torch.Tensor  # [layers, num_logical, max_replicas] int64: its slots, -1 padded

    def slots_of_rank(self, rank: int, num_ranks: int) -> slice:
        per = self.phy_to_log.shape[1] // num_ranks
        return slice(rank * per, (rank + 1) * per)


def balanced_packing(weight: torch.Tensor, num_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [L, n] -> (bin [L, n], rank within its bin [L, n]); every bin gets n / num_bins items. Heaviest
    first onto the lightest bin with room (ties: lowest bin id)."""
    layers, n = weight.shape
    if n % num_bins:
        raise ValueError(f"{n} items do not split evenly over {num_bins} bins")
    per = n // num_bins
    bins = torch.full((layers, n), -1, dtype=torch.int64)
    ranks = torch.full((layers, n), -1, dtype=torch.int64)
    for layer in range(layers):
        load = [0.0] * num_bins
        count = [0] * num_bins
        for item in sorted(range(n), key=lambda i: (-float(weight[layer, i]), i)):
            b = min((j for j in range(num_bins) if count[j] < per), key=lambda j: (load[j], j))
            bins[layer, item], ranks[layer, item] = b, count[b]
            load[b] += float(weight[layer, item])
            count[b] += 1
    return bins, ranks


def replicate(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [L, n] -> (phy_to_log [L, num_physical], replica index of each slot, log_count [L, n]). Slot i < n
    holds expert i; each further slot goes to the expert with the highest load per replica (ties: lowest id)."""
    layers, n = weight.shape
    if num_physical < n:
        raise ValueError(f"{num_physical} physical slots cannot hold {n} experts")
    phy = torch.arange(num_physical, dtype=torch.int64).repeat(layers, 1)
    rep = torch.zeros(layers, num_physical, dtype=torch.int64)
    count = torch.ones(layers, n, dtype=torch.int64)
    for i in range(n, num_physical):
        per_replica = weight.double() / count
        best = per_replica.argmax(dim=-1)  # first maximum: the lowest id on ties
        phy[:, i] = best
        rep[:, i] = count[torch.arange(layers), best]
        count[torch.arange(layers), best] += 1
    return phy, rep, count


def rebalance(weight: torch.Tensor, num_physical: int, num_ranks: int, num_groups: int = 1,
              num_nodes: int = 1) -> Placement:
    """weight [L, num_logical] (recent tokens per expert) -> the placement of ``num_physical`` slots on
    ``num_ranks`` ranks (``num_nodes`` nodes). Hierarchical when groups divide evenly over nodes, else global."""
    layers, n = weight.shape
    if num_physical % num_ranks:
        raise ValueError(f"num_physical={num_physical} does not split evenly over {num_ranks} ranks")
    if num_ranks % num_nodes:
        raise ValueError(f"{num_ranks} ranks do not split evenly over {num_nodes} nodes")
    weight = weight.float().cpu()
    if num_groups % num_nodes or n % num_groups:
        num_groups, num_nodes = 1, 1  # no usable group structure: balance globally
    phy_to_log = _hierarchical(weight, num_physical, num_groups, num_nodes, num_ranks)
    return _placement(phy_to_log, n)


def _hierarchical(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                  num_ranks: int) -> torch.Tensor:
    layers, n = weight.shape
    group_size = n // num_groups
    ranks_per_node = num_ranks // num_nodes
    if num_physical % num_nodes:
        raise ValueError(f"num_physical={num_physical} does not split evenly over {num_nodes} nodes")
    # 1) expert groups onto nodes, by group load
    group_load = weight.view(layers, num_groups, group_size).sum(-1)
    node_of_group, slot_in_node = balanced_packing(group_load, num_nodes)
    # experts in node order: node k holds groups with node_of_group == k, in their packing order
    log_order = torch.empty(layers, n, dtype=torch.int64)
    for layer in range(layers):
        pos = (node_of_group[layer] * (num_groups // num_nodes) + slot_in_node[layer]) * group_size
        for g in range(num_groups):
            log_order[layer, pos[g]:pos[g] + group_size] = torch.arange(g * group_size, (g + 1) * group_size)
    w_node = weight.gather(1, log_order).view(layers * num_nodes, n // num_nodes)
    # 2) replicas within each node
    per_node = num_physical // num_nodes
    phy, _, count = replicate(w_node, per_node)
    # 3) the node's slots onto its ranks, by load per replica
    slot_load = (w_node / count).gather(1, phy)
    rank_of, slot_in_rank = balanced_packing(slot_load, ranks_per_node)
    per_rank = per_node // ranks_per_node
    order = rank_of * per_rank + slot_in_rank  # where each of the node's slots lands
    placed = torch.empty_like(phy)
    placed.scatter_(1, order, phy)
    # back from within-node expert indices to logical expert ids
    node_base = (torch.arange(num_nodes) * (n // num_nodes)).repeat(layers)[:, None]
    within = (placed + node_base).view(layers, num_physical)
    return log_order.gather(1, within)


def _placement(phy_to_log: torch.Tensor, num_logical: int) -> Placement:
    layers, num_physical = phy_to_log.shape
    log_count = torch.zeros(layers, num_logical, dtype=torch.int64)
    log_count.scatter_add_(1, phy_to_log, torch.ones_like(phy_to_log))
    width = int(log_count.max())
    log_to_phy = torch.full((layers, num_logical, width), -1, dtype=torch.int64)
    for layer in range(layers):
        seen = [0] * num_logical
        for slot, e in enumerate(phy_to_log[layer].tolist()):
            log_to_phy[layer, e, seen[e]] = slot
            seen[e] += 1
    return Placement(phy_to_log, log_count, log_to_phy)
