"""Expert load balancing across the expert-parallel ranks, between steps.

Every ``interval`` steps (all ranks count the same steps: replicas run in lockstep) each rank sums the expert loads
it counted since the last rebalance with every other rank's (one all-reduce), computes the new placement from
them (distributed/eplb_policy.py: deterministic, so every rank gets the same one without exchanging it), and the
expert weights move: each new slot takes its expert from the rank already holding it (itself if it can), by
point-to-point sends over the expert-parallel group. The figures (the busiest rank's load over the mean, under
the placement that served the window and under the new one) are kept for metrics.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from openinfer.distributed.eplb_policy import rebalance
from openinfer.distributed.parallel_state import GroupCoordinator
from openinfer.layers.deepseek_moe import DeepseekExperts
from openinfer.step_io import ExpertLoadStats

logger = logging.getLogger(__name__)


def _imbalance(rank_loads: torch.Tensor) -> float:
    mean = float(rank_loads.float().mean())
    return float(rank_loads.max()) / mean if mean > 0 else 1.0


class ExpertRebalancer:
    def __init__(self, model: torch.nn.Module, interval: int) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, DeepseekExperts) and m.count_load]
        self.interval = interval
        self.steps = 0
        self.stats = ExpertLoadStats()

    @property
    def active(self) -> bool:
        return bool(self.layers)

    def reset(self) -> None:
        self.steps = 0
        for m in self.layers:
            m.logical_load.zero_()
            m.slot_load.zero_()

    def after_step(self) -> bool:
        """Count one step; rebalance when the window is full. Returns whether it did."""
        if not self.layers:
            return False
        self.steps += 1
        if self.steps % self.interval:
            return False
        self.rebalance()
        return True

    @torch.no_grad()
    def rebalance(self) -> None:
        first = self.layers[0]
        ep: GroupCoordinator = first.ep
        logical = torch.stack([m.logical_load for m in self.layers])
        slots = torch.stack([m.slot_load for m in self.layers])
        ep.all_reduce(logical)
        ep.all_reduce(slots)
        per_rank = first.num_local_slots
        served = slots.view(len(self.layers), ep.world_size, per_rank).sum(-1).sum(0)
        placement = rebalance(logical, num_physical=first.num_slots, num_ranks=ep.world_size)
        per_slot = (logical.double() / placement.log_count).gather(1, placement.phy_to_log)
        rebalanced = per_slot.view(len(self.layers), ep.world_size, per_rank).sum(-1).sum(0)
        for layer, new in zip(self.layers, placement.phy_to_log):
            _move_experts(layer, new)
            layer.logical_load.zero_()
            layer.slot_load.zero_()
        self.stats = ExpertLoadStats(self.stats.num_rebalances + 1, self.interval, _imbalance(served),
                                     _imbalance(rebalanced), served.tolist())
        logger.info("expert rebalance %d: busiest rank / mean %.2f -> %.2f", self.stats.num_rebalances,
                    self.stats.imbalance_served, self.stats.imbalance_rebalanced)


def _move_experts(layer: DeepseekExperts, new_phy_to_log: torch.Tensor) -> None:
    """Give every local slot the weights of its new expert, taking each from the rank that already holds it
    (this rank when it does: a local copy), over point-to-point sends on the expert-parallel group."""
    ep, per, me = layer.ep, layer.num_local_slots, layer.ep.rank_in_group
    old = layer.map.phy_to_log
    new = new_phy_to_log.to(torch.long).cpu()
    w13, w2 = (w.clone() for w in layer.dense_weights())
    new13, new2 = torch.empty_like(w13), torch.empty_like(w2)
    ops: list[dist.P2POp] = []
    for slot in range(layer.num_slots):
        expert, dst = int(new[slot]), slot // per
        holders = [s for s in range(layer.num_slots) if int(old[s]) == expert]
        src_slot = next((s for s in holders if s // per == dst), holders[0])
        src = src_slot // per
        if src == dst == me:
            new13[slot - dst * per] = w13[src_slot - me * per]
            new2[slot - dst * per] = w2[src_slot - me * per]
        elif src == me:
            for which, w in ((0, w13), (1, w2)):
                ops.append(dist.P2POp(dist.isend, w[src_slot - me * per].contiguous(), ep.ranks[dst],
                                      group=ep.device_group, tag=2 * slot + which))
        elif dst == me:
            for which, buf in ((0, new13), (1, new2)):
                ops.append(dist.P2POp(dist.irecv, buf[slot - me * per], ep.ranks[src], group=ep.device_group,
                                      tag=2 * slot + which))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    layer.set_weights(new13, new2)
    layer.map.update(new)
