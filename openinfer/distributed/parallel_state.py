"""The process groups of one deployment and the collectives layers use.

Ranks are laid out as ``rank = dp_rank * tp_size + tp_rank``: the ``tp_size`` ranks of one data-parallel replica are
neighbours. Each group has a device group (gloo on CPU, NCCL on CUDA) for tensors and, beside it, a CPU (gloo) group
for control messages, so control traffic never waits behind device work.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class GroupCoordinator:
    """One process group as a layer sees it. ``world_size == 1`` makes every collective a no-op."""

    ranks: list[int] = field(default_factory=lambda: [0])
    rank_in_group: int = 0
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (returns x)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (any length), in rank order, over the CPU group: how ranks share msgpack-encoded
        messages without pickle (torch's ``all_gather_object`` pickles)."""
        if self.world_size == 1:
            return [data]
        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, n, group=self.cpu_group)
        longest = max(int(s) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(parts, buf, group=self.cpu_group)
        return [bytes(p[:int(s)].numpy()) for p, s in zip(parts, sizes)]

    def broadcast_bytes(self, data: bytes, src: int = 0) -> bytes:
        """Group rank ``src``'s ``data`` on every rank, over the CPU group (what other ranks pass is ignored)."""
        if self.world_size == 1:
            return data
        root = self.ranks[src]
        n = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(n, root, group=self.cpu_group)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank_in_group == src and data
               else torch.empty(int(n), dtype=torch.uint8))
        if int(n):
            dist.broadcast(buf, root, group=self.cpu_group)
        return bytes(buf.numpy())

    def all_reduce_cpu(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """A control-plane reduction over the CPU group (e.g. "does any rank have work")."""
        if self.world_size > 1:
            dist.all_reduce(x, op=op, group=self.cpu_group)
        return x


_WORLD = GroupCoordinator()
_TP = GroupCoordinator()
_DP = GroupCoordinator()
_EP = GroupCoordinator()


def get_world_group() -> GroupCoordinator:
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_ep_group() -> GroupCoordinator:
    """The ranks that split the routed experts (every rank of the deployment, with expert parallelism on)."""
    return _EP


def get_dp_group() -> GroupCoordinator:
    """The ranks holding the same tensor-parallel shard in every data-parallel replica."""
    return _DP


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _TP.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _TP.all_gather(x, dim)


def device_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed_environment(world_size: int, rank: int, init_method: str, device: torch.device,
                                 timeout_s: float = 60.0) -> None:
    """Join the deployment's default group. On loopback, gloo is told to use ``lo`` (it otherwise binds the
    address the hostname resolves to). ``timeout_s`` bounds every collective: a rank that stops answering fails
    the others instead of hanging them."""
    if dist.is_initialized():
        return
    addr = os.environ.get("MASTER_ADDR", "") if init_method == "env://" else init_method
    if "127.0.0.1" in addr or "localhost" in addr:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=timeout_s)
    if init_method.startswith("store://"):  # a store the launcher already serves: every rank is its client
        host, port = init_method.removeprefix("store://").rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        dist.init_process_group(device_backend(device), store=store, world_size=world_size, rank=rank,
                                timeout=timeout)
    else:
        dist.init_process_group(device_backend(device), init_method=init_method, world_size=world_size, rank=rank,
                                timeout=timeout)
    global _WORLD
    cpu = dist.new_group(list(range(world_size)), backend="gloo") if device.type == "cuda" else dist.group.WORLD
    _WORLD = GroupCoordinator(list(range(world_size)), rank, dist.group.WORLD, cpu)
    logger.debug("rank %d of %d joined %s", rank, world_size, init_method)


def _make_group(ranks: list[int], device: torch.device) -> GroupCoordinator:
    """Create one group (every rank of the world must call this for every group, in the same order)."""
    if len(ranks) == _WORLD.world_size:  # the whole world: reuse its groups
        dev, cpu = _WORLD.device_group, _WORLD.cpu_group
    else:
        dev = dist.new_group(ranks, backend=device_backend(device))
        cpu = dist.new_group(ranks, backend="gloo") if device.type == "cuda" else dev
    rank = _WORLD.rank_in_group
    return GroupCoordinator(ranks, ranks.index(rank) if rank in ranks else -1, dev, cpu)


def initialize_model_parallel(tensor_parallel_size: int, data_parallel_size: int, device: torch.device,
                              expert_parallel: bool = False) -> None:
    """Tensor-parallel groups of consecutive ranks (one per data-parallel replica), data-parallel groups of the
    ranks that hold the same shard in each replica, and with expert parallelism one group of every rank."""
    global _TP, _DP, _EP
    tp, dp = tensor_parallel_size, data_parallel_size
    if _WORLD.world_size != tp * dp:
        raise ValueError(f"world size {_WORLD.world_size} != tensor_parallel_size={tp} x data_parallel_size={dp}")
    rank = _WORLD.rank_in_group
    for d in range(dp):
        g = _make_group(list(range(d * tp, (d + 1) * tp)), device)
        if g.rank_in_group >= 0:
            _TP = g
    for t in range(tp):
        g = _make_group(list(range(t, tp * dp, tp)), device)
        if rank in g.ranks:
            _DP = g
    if expert_parallel:
        _EP = _make_group(list(range(tp * dp)), device)


def destroy_distributed_environment() -> None:
    global _WORLD, _TP, _DP, _EP
    _WORLD, _TP, _DP, _EP = GroupCoordinator(), GroupCoordinator(), GroupCoordinator(), GroupCoordinator()
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class EplbSettings:
    """Expert load balancing, as the MoE layers read it: redundant expert slots beyond the logical experts, and
    whether loads are counted and placement rebalanced."""

    enabled: bool = False
    num_redundant_experts: int = 0


_EPLB = EplbSettings()


def get_eplb_settings() -> EplbSettings:
    return _EPLB


def set_eplb_settings(settings: EplbSettings) -> None:
    global _EPLB
    _EPLB = settings
