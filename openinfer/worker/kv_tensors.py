"""A bound model's KV stores by group: every tensor whose first dimension is a block id of that group, in module
order (the same on every instance of the same model and settings). What a KV connector registers and transfers.

DeepSeek-V4 / V4.1 layer caches name each store's group (``store_groups``); a V4.1 layer that shares another's
compressed KV or index keys holds no store for them, so every store is transferred once. V4.1's Engram token ids
(``ids_store``, int64, window-group blocks) travel too: a decoder's Engram reads N-1 ids back from its first
token."""
from __future__ import annotations

import torch

from openinfer.layers.attention import Attention
from openinfer.layers.mla import MLAAttention
from openinfer.models.deepseek_v4.cache import V4LayerCache
from openinfer.models.deepseek_v41.cache import WINDOW as V41_WINDOW
from openinfer.models.deepseek_v41.cache import LayerCache as V41LayerCache
from openinfer.models.deepseek_v41.model import DeepseekV41Model


def kv_block_tensors(model: torch.nn.Module, group_names: list[str]) -> dict[str, list[torch.Tensor]]:
    groups: dict[str, list[torch.Tensor]] = {name: [] for name in group_names}
    for m in model.modules():
        if isinstance(m, Attention):
            groups[m.kv_group] += [m.k_cache, m.v_cache]
        elif isinstance(m, MLAAttention):
            groups[m.kv_group].append(m.kv_cache)
        elif isinstance(getattr(m, "cache", None), (V4LayerCache, V41LayerCache)):
            for name in m.cache.names:
                groups[m.cache.store_groups[name]].append(getattr(m.cache, name))
        elif isinstance(m, DeepseekV41Model) and m.ids_store is not None:
            groups[V41_WINDOW].append(m.ids_store)
    for name, tensors in groups.items():
        if not tensors:
            raise ValueError(f"KV group {name!r} has no stores this connector knows how to transfer")
        for t in tensors:
            if t is None or not t.is_contiguous():
                raise ValueError(f"KV group {name!r}: a store is unbound or not contiguous")
    return groups
