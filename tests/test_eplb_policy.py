"""The expert placement policy (distributed/eplb_policy.py): every logical expert placed at least once, slots split
evenly over ranks, the busiest rank's load lowered on skewed loads, hierarchical placement keeps groups on nodes."""
from __future__ import annotations

import torch

from openinfer.distributed.eplb_policy import balanced_packing, rebalance, replicate


def rank_loads(weight: torch.Tensor, placement, num_ranks: int) -> torch.Tensor:
    """[L, ranks]: tokens each rank serves when an expert's load is spread evenly over its replicas."""
    per_slot = (weight.float() / placement.log_count).gather(1, placement.phy_to_log)
    return per_slot.view(weight.shape[0], num_ranks, -1).sum(-1)


def naive_loads(weight: torch.Tensor, num_ranks: int) -> torch.Tensor:
    return weight.float().view(weight.shape[0], num_ranks, -1).sum(-1)


def test_packing_is_even_and_greedy():
    bins, ranks = balanced_packing(torch.tensor([[9.0, 1, 8, 2, 7, 3]]), 3)
    assert sorted(bins[0].tolist()) == [0, 0, 1, 1, 2, 2]
    load = [sum(v for v, b in zip([9, 1, 8, 2, 7, 3], bins[0].tolist()) if b == k) for k in range(3)]
    assert max(load) - min(load) <= 1
    assert all(sorted(ranks[0][bins[0] == k].tolist()) == [0, 1] for k in range(3))


def test_replicas_go_to_the_hottest_experts():
    phy, rep, count = replicate(torch.tensor([[100.0, 1, 1, 50]]), 7)
    assert phy[0, :4].tolist() == [0, 1, 2, 3]
    assert count[0].tolist() == [3, 1, 1, 2]  # 100/3 > 50/2 > ... : expert 0 twice more, expert 3 once
    assert sorted(rep[0, 4:].tolist()) == [1, 1, 2]


def test_skewed_load_max_over_mean_drops_and_every_expert_is_placed():
    torch.manual_seed(0)
    layers, experts, ranks = 3, 16, 4
    weight = torch.randint(1, 10, (layers, experts)).float()
    weight[:, 0] += 400  # one hot expert
    weight[:, 5] += 200
    placement = rebalance(weight, num_physical=20, num_ranks=ranks)
    assert (placement.log_count >= 1).all() and placement.log_count.sum(-1).tolist() == [20] * layers
    before = naive_loads(weight, ranks)
    after = rank_loads(weight, placement, ranks)
    assert torch.allclose(after.sum(-1), weight.sum(-1))  # no token lost
    ratio_before = (before.max(-1).values / before.mean(-1)).min()
    ratio_after = (after.max(-1).values / after.mean(-1)).max()
    assert ratio_after < ratio_before and ratio_after < 1.3
    for layer in range(layers):  # log_to_phy is the inverse of phy_to_log
        for e in range(experts):
            slots = [s for s in placement.log_to_phy[layer, e].tolist() if s >= 0]
            assert len(slots) == placement.log_count[layer, e]
            assert all(placement.phy_to_log[layer, s] == e for s in slots)


def test_hierarchical_keeps_each_group_on_one_node():
    weight = torch.arange(1, 17, dtype=torch.float32)[None].repeat(2, 1)
    placement = rebalance(weight, num_physical=24, num_ranks=4, num_groups=4, num_nodes=2)
    group_of = placement.phy_to_log // 4
    for layer in range(2):
        nodes = [set(group_of[layer, :12].tolist()), set(group_of[layer, 12:].tolist())]
        assert not nodes[0] & nodes[1] and nodes[0] | nodes[1] == {0, 1, 2, 3}
    assert (placement.log_count >= 1).all()
