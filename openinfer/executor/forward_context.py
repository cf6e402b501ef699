"""Per-step metadata that reaches attention layers without threading it through every ``forward()``.

The model runner builds one ``AttentionMetadata`` per step and sets it around the forward pass. Sequences are
ordered decodes first (one query token each) so the decode part is one contiguous, batchable slice.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    """One sequence computing more than one token this step (a prompt chunk, or a recompute)."""

    query_start: int  # offset in the flat token batch
    query_len: int
    context_len: int  # tokens in the KV cache after this step, including these queries
    block_table: torch.Tensor  # [num_blocks] int64
    window_block_table: torch.Tensor | None = None  # the window group's table (hybrid models), same length


@dataclass
class AttentionMetadata:
    num_tokens: int
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token
    num_decodes: int  # the first num_decodes tokens belong to single-token sequences
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64 (padded with 0)
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks*block_size] bool
    prefills: list[PrefillSpan]
    # Hybrid models (kv_groups.WINDOW): slots and decode tables in the window group's blocks; None otherwise.
    window_slot_mapping: torch.Tensor | None = None
    window_decode_block_tables: torch.Tensor | None = None
    # Models with a kv_groups.COARSE group: its tables, one row per sequence in step order (decodes first).
    coarse_block_tables: torch.Tensor | None = None
    _decode_bias: dict = field(default_factory=dict, repr=False)

    def decode_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``decode_mask`` as an additive float mask, built once per step and dtype: SDPA would otherwise
        convert the bool mask again in every layer."""
        if self.decode_mask is None:
            return None
        bias = self._decode_bias.get(dtype)
        if bias is None:
            bias = torch.zeros(self.decode_mask.shape, dtype=dtype, device=self.decode_mask.device)
            bias.masked_fill_(~self.decode_mask, float("-inf"))
            self._decode_bias[dtype] = bias
        return bias


_CURRENT: AttentionMetadata | None = None


def get_forward_context() -> AttentionMetadata:
    if _CURRENT is None:
        raise RuntimeError("attention called outside a model-runner step (no forward context set)")
    return _CURRENT


@contextlib.contextmanager
def set_forward_context(md: AttentionMetadata):
    global _CURRENT
    prev, _CURRENT = _CURRENT, md
    try:
        yield
    finally:
        _CURRENT = prev
