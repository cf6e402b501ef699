"""Which logical expert each physical expert slot holds, and how a token's chosen expert becomes a slot.

With expert load balancing (or redundant experts) the routed experts live in ``num_slots`` slots, a contiguous
range per expert-parallel rank; a busy expert may hold several slots (replicas). A (token, choice) pair goes to
replica ``pair index mod replicas`` of its expert: deterministic, and spread evenly over the replicas.
"""
from __future__ import annotations

import torch


class ExpertMap:
    def __init__(self, phy_to_log: torch.Tensor, num_experts: int) -> None:
        self.num_experts = num_experts
        self.update(phy_to_log)

    def update(self, phy_to_log: torch.Tensor) -> None:
        phy_to_log = phy_to_log.to(torch.long).cpu()
        count = torch.bincount(phy_to_log, minlength=self.num_experts)
        if int(count.min()) < 1:
            raise ValueError(f"every expert needs a slot; experts {torch.nonzero(count == 0).flatten().tolist()} "
                             "have none")
        log_to_phy = torch.zeros(self.num_experts, int(count.max()), dtype=torch.long)
        seen = [0] * self.num_experts
        for slot, e in enumerate(phy_to_log.tolist()):
            log_to_phy[e, seen[e]] = slot
            seen[e] += 1
        self.phy_to_log, self.log_count, self.log_to_phy = phy_to_log, count, log_to_phy

    @property
    def num_slots(self) -> int:
        return self.phy_to_log.shape[0]

    def to_slots(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, K] logical ids -> [T, K] slot ids."""
        ids = topk_ids.to(torch.long)
        pair = torch.arange(ids.numel(), device=ids.device).view(ids.shape)
        replica = pair % self.log_count.to(ids.device)[ids]
        return self.log_to_phy.to(ids.device)[ids, replica]

    def slots_of(self, expert: int, first: int, count: int) -> list[int]:
        """The local slots (offsets from ``first``) among ``count`` that hold ``expert``."""
        return [s - first for s in range(first, first + count) if int(self.phy_to_log[s]) == expert]
