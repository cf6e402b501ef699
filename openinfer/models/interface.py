"""The contract between the worker's model runner and every model: one path for all of them, no probing.

A model is an ``nn.Module`` built as ``cls(hf_config, attention_backend=...)`` under the target dtype and device
(the loader sets both), filled by ``load_weights``, then given its KV cache by ``bind_kv_cache``. Per step the
runner sets the forward context (``openinfer.forward_context``: positions, per-KV-group block tables) and calls
``forward``; layers read the tables of the groups the model declared in ``kv_cache_spec``.

``forward`` returns the model's last per-token state before its output head - what a speculative proposer
(DeepSeek MTP) consumes next to the sampled token - and ``compute_logits`` applies the head to the rows the
runner needs (sampled positions, prompt-logprob positions). For dense models and DeepSeek-V3 that state is the
final normed hidden state; for DeepSeek-V4 it is the mHC streams before ``hc_head``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from openinfer.config import AttentionBackend
from openinfer.kv_cache_interface import KVGroupSpec


@runtime_checkable
class CausalLM(Protocol):
    def __init__(self, hf_config: dict[str, Any], *, attention_backend: AttentionBackend = ...) -> None: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] (the step's tokens, flat) -> [T, ...] state before the output head."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of ``forward``'s result -> logits [rows, vocab]."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume (checkpoint name, tensor) pairs; raise ``WeightLoadError`` naming what is missing or foreign."""
        ...

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
        """The KV groups this model's layers read and write, with their exact bytes per block. ``dtype`` here and
        in ``bind_kv_cache`` is what the cache stores: the model's dtype, or float8_e4m3fn for kv_cache_dtype fp8
        (only for a class whose ``supported_kv_cache_dtypes`` lists it; engine_args checks)."""
        ...

    def bind_kv_cache(self, num_blocks: Mapping[str, int], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        """Allocate every layer's stores for ``num_blocks`` blocks per group (replacing any earlier ones)."""
        ...

    def free_kv_cache(self) -> None:
        """Drop the stores (the runner's warm-up uses a throwaway cache)."""
        ...
