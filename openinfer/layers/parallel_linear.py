"""Tensor-parallel linear layers (Megatron's split, as vLLM names them) over the prepacked ``Linear``.

- ``ColumnParallelLinear``: W split by output rows; rank r computes its slice of the outputs (optionally gathered).
  A fused projection (q|k|v, gate|up) lists its parts in ``output_sizes``; each part is split on its own, so
  rank r holds the r-th slice of every part, side by side.
- ``RowParallelLinear``: W split by input columns; each rank multiplies its slice of the inputs and the partial
  results are summed (one all-reduce); the bias is added once, by rank 0.
Each parameter carries a ``weight_loader(param, checkpoint_tensor, part)`` that reads only its rank's slice of the
checkpoint tensor (layers/weight_utils.py). With one rank these are plain ``Linear``\\ s.
"""
from __future__ import annotations

import torch
from torch import nn

from openinfer.distributed.parallel_state import GroupCoordinator, get_tp_group
from openinfer.layers.linear import CheckpointLinear
from openinfer.layers.weight_utils import WeightLoadError, materialize, narrow


def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={d}")
    return n // d


def _single_rank_only(tp: GroupCoordinator) -> None:
    # A low-bit checkpoint's weight is kept in its packed form; slicing it per rank (int4 groups along K for the
    # row-parallel layers) is not implemented.
    if tp.world_size > 1:
        raise WeightLoadError("low-bit checkpoints (compressed-tensors, GPTQ) load with tensor_parallel_size=1 only")


def _check_shape(loaded, dim: int, want: int, what: str) -> None:
    if loaded.shape[dim] != want:
        raise WeightLoadError(f"{what}: checkpoint dim {dim} is {loaded.shape[dim]}, the model expects {want}")


class ColumnParallelLinear(CheckpointLinear):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, gather_output: bool = False,
                 tp: GroupCoordinator | None = None) -> None:
        self.tp = tp or get_tp_group()
        self.output_sizes = list(output_sizes)
        self.local_sizes = self._local_sizes()
        super().__init__(input_size, sum(self.local_sizes), bias=bias)
        self.gather_output = gather_output
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def _local_sizes(self) -> list[int]:
        return [divide(s, self.tp.world_size, "output size") for s in self.output_sizes]

    def _source_offset(self, part: int) -> int:
        """Where this rank's slice of part ``part`` starts in the checkpoint tensor."""
        return self.tp.rank_in_group * self.local_sizes[part]

    def weight_loader(self, param: torch.Tensor, loaded, part: int | None = None) -> None:
        """``part`` None: the checkpoint tensor holds every part (already fused); else just part ``part``."""
        if part is None:
            _check_shape(loaded, 0, sum(self.output_sizes), f"a {type(self).__name__} weight")
        else:
            _check_shape(loaded, 0, self.output_sizes[part], f"part {part} of a {type(self).__name__}")
        with torch.no_grad():
            for i in (range(len(self.output_sizes)) if part is None else [part]):
                n, dst = self.local_sizes[i], sum(self.local_sizes[:i])
                start = (sum(self.output_sizes[:i]) if part is None else 0) + self._source_offset(i)
                piece = narrow(loaded, 0, start, n)
                if piece.shape[1:] != param.shape[1:]:
                    raise WeightLoadError(f"checkpoint slice has shape {tuple(piece.shape)}, the model expects "
                                          f"(..., {', '.join(map(str, param.shape[1:]))})")
                param[dst:dst + n].copy_(piece)

    def load_quantized(self, qw, part: int | None = None, sizes: list[int] | None = None) -> None:
        _single_rank_only(self.tp)
        super().load_quantized(qw, part, self.output_sizes if part is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return self.tp.all_gather(y, dim=-1) if self.gather_output else y


class QKVParallelLinear(ColumnParallelLinear):
    """q | k | v for ``num_heads`` query and ``num_kv_heads`` key/value heads of ``head_dim``. Query heads are split
    evenly; with more ranks than KV heads each KV head is replicated on ``tp / num_kv_heads`` ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp: GroupCoordinator | None = None) -> None:
        tp = tp or get_tp_group()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.world_size, "num_attention_heads")
        if num_kv_heads >= tp.world_size:
            self.num_kv_heads = divide(num_kv_heads, tp.world_size, "num_key_value_heads")
            self._kv_head_start = tp.rank_in_group * self.num_kv_heads
        else:
            divide(tp.world_size, num_kv_heads, "(replicating KV heads) world size")
            self.num_kv_heads = 1
            self._kv_head_start = tp.rank_in_group * num_kv_heads // tp.world_size
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias=bias, tp=tp)

    def _local_sizes(self) -> list[int]:
        kv = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv, kv]

    def _source_offset(self, part: int) -> int:
        if part == 0:
            return self.tp.rank_in_group * self.local_sizes[0]
        return self._kv_head_start * self.head_dim


class RowParallelLinear(CheckpointLinear):
    """``reduce_results=False`` leaves the partial sums to the caller, who adds more partial results (an MoE's
    shared and routed experts) and reduces once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True,
                 tp: GroupCoordinator | None = None) -> None:
        self.tp = tp or get_tp_group()
        self.reduce_results = reduce_results
        self.input_size_full = input_size
        super().__init__(divide(input_size, self.tp.world_size, "input size"), output_size, bias=bias)
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = self._bias_loader

    def weight_loader(self, param: torch.Tensor, loaded, part: int | None = None) -> None:
        _check_shape(loaded, 1, self.input_size_full, "a RowParallelLinear weight")
        n = param.shape[1]
        with torch.no_grad():
            param.copy_(narrow(loaded, 1, self.tp.rank_in_group * n, n))

    def _bias_loader(self, param: torch.Tensor, loaded, part: int | None = None) -> None:
        _check_shape(loaded, 0, param.shape[0], "a RowParallelLinear bias")
        with torch.no_grad():
            param.copy_(materialize(loaded))

    def load_quantized(self, qw, part: int | None = None, sizes: list[int] | None = None) -> None:
        _single_rank_only(self.tp)
        super().load_quantized(qw, part, sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.matmul(x, self.bias)
        # The partial sums are added across ranks; the bias must be added exactly once.
        y = self.matmul(x, self.bias if self.tp.is_first_rank else None)
        return self.tp.all_reduce(y) if self.reduce_results else y


def sharded_parameter(full_size: int, *rest: int, dtype: torch.dtype | None = None,
                      tp: GroupCoordinator | None = None) -> nn.Parameter:
    """A parameter split along dim 0 over the tensor-parallel ranks (per-head values such as attention sinks),
    loading only its rank's slice."""
    tp = tp or get_tp_group()
    n = divide(full_size, tp.world_size, "sharded size")
    param = nn.Parameter(torch.zeros(n, *rest, dtype=dtype), requires_grad=False)

    def weight_loader(p: torch.Tensor, loaded, part=None) -> None:
        _check_shape(loaded, 0, full_size, "a tensor-parallel sharded parameter")
        with torch.no_grad():
            p.copy_(narrow(loaded, 0, tp.rank_in_group * n, n))

    param.weight_loader = weight_loader
    return param
