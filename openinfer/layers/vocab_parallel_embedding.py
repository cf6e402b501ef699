"""Token embedding and LM head split over the vocabulary (tensor parallel).

Rank r holds rows [r * V', (r+1) * V') of the table, V' = ceil(vocab / tp) (the last shard padded with zero rows
that no token id reaches). The embedding looks up the ids in its shard, zeroes the others and sums over ranks;
the head computes its shard's logits and gathers them. Tied weights share the shard as they share the table.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.distributed.parallel_state import GroupCoordinator, get_tp_group
from openinfer.layers import dispatch
from openinfer.layers.linear import CheckpointLinear
from openinfer.layers.weight_utils import WeightLoadError, narrow


def _load_vocab_shard(param: torch.Tensor, loaded, vocab_size: int, start: int) -> None:
    if tuple(loaded.shape) != (vocab_size, param.shape[1]):
        raise WeightLoadError(f"vocabulary table has shape {tuple(loaded.shape)}, the model expects "
                              f"({vocab_size}, {param.shape[1]})")
    n = max(0, min(param.shape[0], vocab_size - start))
    with torch.no_grad():
        if n:
            param[:n].copy_(narrow(loaded, 0, start, n))
        param[n:].zero_()


class VocabParallelEmbedding(nn.Module):
    _quant = None  # a GGUF file's quantized table (``load_quantized``)

    def __init__(self, vocab_size: int, hidden_size: int, tp: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.tp = tp or get_tp_group()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp.world_size)
        self.start = self.tp.rank_in_group * self.shard_size
        # torch.empty: every row is loaded from the checkpoint (or zeroed as padding)
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded, part=None) -> None:
        _load_vocab_shard(param, loaded, self.vocab_size, self.start)

    @torch.no_grad()
    def load_quantized(self, qw, part: int | None = None) -> None:
        """A GGUF file's block-quantized table (``layers/gguf_quant.GGUFWeight``) kept packed: a lookup dequantises
        only the rows it reads. ``weight`` becomes an empty placeholder."""
        if self.tp.world_size != 1:
            raise ValueError("a quantized token embedding is not split over tensor-parallel ranks; run it with "
                             "tensor_parallel_size 1")
        if tuple(qw.shape) != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(f"vocabulary table has shape {tuple(qw.shape)}, the model expects "
                             f"({self.vocab_size}, {self.weight.shape[1]})")
        qw.dtype = self.weight.dtype
        self._quant = qw
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self._quant is not None:
            return self._quant.rows(input_ids.reshape(-1)).to(self._quant.dtype).view(*input_ids.shape, -1)
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(CheckpointLinear):
    def __init__(self, vocab_size: int, hidden_size: int, tp: GroupCoordinator | None = None) -> None:
        self.tp = tp or get_tp_group()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp.world_size)
        super().__init__(hidden_size, self.shard_size, bias=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded, part=None) -> None:
        _load_vocab_shard(param, loaded, self.vocab_size, self.tp.rank_in_group * self.shard_size)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if getattr(self._quant, "method", None) == "gguf":
            # The logits keep fp32 activations where GGUF linears quantise theirs to int8 (as int8 schemes leave
            # lm_head out: bitsandbytes' LLM.int8, GPTQ / AWQ): the greedy pick is read off these values, and
            # rounding both the last layers' and the head's inputs flipped SmolLM2's near-tied first token of
            # "What is the capital of France?" (0.09 apart) to llama.cpp's "L'Étoile, ..." (docs/gguf_kernels.md).
            # OPENINFER_GGUF_ACTIVATIONS=int8 asks for llama.cpp's arithmetic everywhere, the head included.
            logits = self._quant.matmul(hidden, None, fp32_activations=not dispatch.active().gguf_int8_everywhere)
        else:
            logits = self.matmul(hidden, None)
        if self.tp.world_size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[..., :self.vocab_size]
