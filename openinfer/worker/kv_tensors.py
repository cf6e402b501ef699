"""A bound model's KV stores by group: every tensor whose first dimension is a block id of that group, in module
order (the same on every instance of the same model and settings). What a KV connector registers and transfers.

The model lists its stores (``CausalLM.kv_stores``, models/interface.py): the shared attention layers' caches and
those of every model part that owns others (DeepSeek-V4 / V4.1 layer caches name each store's group; a V4.1 layer
that shares another's compressed KV or index keys holds no store for them, so every store is transferred once;
V4.1's Engram token ids travel with the window group). A speculative proposer's stores (an MTP layer's, a draft
model's, DSpark's context keys) follow under their engine group names (``mtp.full``, ...), so a connector moves the
drafter's KV with the target's."""
from __future__ import annotations

import torch

from openinfer.models.interface import CausalLM, KVStores


def kv_block_tensors(model: CausalLM, group_names: list[str], extra: KVStores = (),
                     empty_ok: frozenset[str] = frozenset()) -> dict[str, list[torch.Tensor]]:
    """``extra``: the proposer's stores (``Proposer.kv_stores``), already under the engine's group names;
    ``empty_ok``: groups of 0 bytes per block (a DeepSeek-V4 MTP layer's full / coarse groups: a sliding-window layer
    compresses nothing), which have no store."""
    groups: dict[str, list[torch.Tensor]] = {name: [] for name in group_names}
    for group, tensor in [*model.kv_stores(), *extra]:
        groups[group].append(tensor)
    for name, tensors in groups.items():
        if not tensors and name not in empty_ok:
            raise ValueError(f"KV group {name!r} has no stores this connector knows how to transfer")
        for t in tensors:
            if t is None or not t.is_contiguous():
                raise ValueError(f"KV group {name!r}: a store is unbound or not contiguous")
    return groups
