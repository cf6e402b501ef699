"""What proposers with weights share: their KV groups in the engine's block manager under a prefix, the forward
context over those groups, and how far a request may draft.

A drafting module's groups are renamed ``<prefix><name>`` for the engine, so they never collide with the
target's, and keep the target's block positions: whatever the scheduler does to a request's blocks (prefix hits,
chunked prefill, preemption, freeing) holds for the drafter's KV too. A chain of k drafts writes KV rows past the
request's known tokens, into the lookahead slots the scheduler allocates (``SchedulerConfig.num_lookahead_tokens``);
the next step's forward overwrites them.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from openinfer.forward_context import AttentionMetadata
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.models.interface import CausalLM, KVStores, module_kv_stores
from openinfer.worker.input_batch import CachedRequestState, InputBatch
from openinfer.worker.proposers import Proposer


class DraftingModel(Proposer):
    prefix: str

    def __init__(self, module: nn.Module, k: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.module, self.k, self.max_model_len = module, k, max_model_len
        self.block_size, self.device = block_size, device
        self._groups: list[str] = []  # the module's own group names

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
        specs = self.module.kv_cache_spec(block_size, dtype)
        self._groups = [s.name for s in specs]
        return [replace(s, name=self.prefix + s.name) for s in specs]

    def bind_kv_cache(self, num_blocks: dict[str, int], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        self.module.bind_kv_cache({g: num_blocks[self.prefix + g] for g in self._groups}, block_size, dtype, device)

    def free_kv_cache(self) -> None:
        self.module.free_kv_cache()

    def kv_stores(self) -> KVStores:
        stores = self.module.kv_stores() if isinstance(self.module, CausalLM) else module_kv_stores(self.module)
        return [(self.prefix + g, t) for g, t in stores]

    # -- helpers for propose() ---------------------------------------------------------------------------------
    def group_rows(self, batch: InputBatch) -> dict[str, int]:
        """The module's group name -> index of its ``<prefix>`` table in each request's ``block_ids``."""
        return {g: batch.group_names.index(self.prefix + g) for g in self._groups}

    def held(self, st: CachedRequestState, gidx: dict[str, int], batch: InputBatch) -> int:
        """Token positions the request's blocks of the drafter's groups cover."""
        return min(len(st.block_ids[i]) * batch.tokens_per_block[self.prefix + g] for g, i in gidx.items())

    def room(self, st: CachedRequestState, last_kv_pos: int, gidx: dict[str, int], batch: InputBatch) -> int:
        """Drafts worth making for a request whose first draft's chain step writes KV at ``last_kv_pos + 1``: at
        most k, none past the context or the request's remaining tokens (the scheduler trims by the same
        limits), and every chain position inside the blocks the request holds."""
        n = len(st.token_ids)
        max_tokens = st.sampling_params.max_tokens
        left = self.k if max_tokens is None else max_tokens - len(st.output_token_ids) - 1
        in_blocks = self.held(st, gidx, batch) - last_kv_pos  # chain step j writes at last_kv_pos + j, j < room
        return max(0, min(self.k, self.max_model_len - n - 1, in_blocks, left))

    def metadata(self, query_lens: list[int], context_lens: list[int], states: list[CachedRequestState],
                 batch: InputBatch, gidx: dict[str, int]) -> AttentionMetadata:
        """The module's forward context: its own group names over the engine's ``<prefix>*`` block tables."""
        return AttentionMetadata.build(
            query_lens, context_lens, {g: [st.block_table(i) for st in states] for g, i in gidx.items()},
            {g: batch.tokens_per_block[self.prefix + g] for g in gidx}, self.block_size, self.device)
