"""A bound model's KV stores by group: every tensor whose first dimension is a block id of that group, in module
order (the same on every instance of the same model and settings). What a KV connector registers and transfers.

The model lists its stores (``CausalLM.kv_stores``, models/interface.py): the shared attention layers' caches and
those of every model part that owns others (DeepSeek-V4 / V4.1 layer caches name each store's group; a V4.1 layer
that shares another's compressed KV or index keys holds no store for them, so every store is transferred once;
V4.1's Engram token ids travel with the window group). A speculative proposer's stores (an MTP layer's, a draft
model's, DSpark's context keys) follow under their engine group names (``mtp.full``, ...), so a connector moves the
drafter's KV with the target's; a store both list (V4's MTP block is a module of the target too) is the proposer's
only."""
from __future__ import annotations

import torch

from openinfer.config import EngineConfig
from openinfer.layers.attention import Attention
from openinfer.models.interface import CausalLM
from openinfer.worker.proposers import Proposer


def kv_block_tensors(model: CausalLM, group_names: list[str], proposer: Proposer | None = None,
                     storeless: frozenset[str] = frozenset()) -> dict[str, list[torch.Tensor]]:
    """``storeless``: groups declared with 0 bytes per block (V4's MTP block, a sliding-window layer, has no
    full-group store); they move nothing."""
    groups: dict[str, list[torch.Tensor]] = {name: [] for name in group_names}
    drafting = proposer.kv_stores() if proposer is not None else []
    theirs = {id(t) for _, t in drafting}
    for group, tensor in [*((g, t) for g, t in model.kv_stores() if id(t) not in theirs), *drafting]:
        if group not in groups:
            raise ValueError(f"a KV store names group {group!r}, which the cache does not have ({group_names})")
        groups[group].append(tensor)
    for name, tensors in groups.items():
        if not tensors and name not in storeless:
            raise ValueError(f"KV group {name!r} has no stores this connector knows how to transfer")
        for t in tensors:
            if t is None or not t.is_contiguous():
                raise ValueError(f"KV group {name!r}: a store is unbound or not contiguous")
    return groups


def kv_settings(config: EngineConfig, group_names: list[str], kv_dtype: torch.dtype) -> str:
    """The settings that shape the KV stores, in words: what a KV connector's handshake shows the other side, so a
    layout mismatch names both instances' settings."""
    sp = config.speculative
    drafter = "none" if sp is None else f"{sp.method} k={sp.num_speculative_tokens}"
    name = config.model.path.rstrip("/").rsplit("/", 1)[-1]
    return (f"model={config.model.architecture or '?'} ({name}), block_size={config.cache.block_size}, "
            f"kv dtype={str(kv_dtype).removeprefix('torch.')}, KV groups={group_names}, speculative_config={drafter}, "
            f"tensor_parallel_size={config.parallel.tensor_parallel_size}")


def head_split_rows(model: CausalLM, proposer: Proposer | None) -> dict[int, int]:
    """id(store) -> token rows per block, for every store split by KV heads over the tensor-parallel ranks
    (``Attention``'s ``[block, token, kv head, head dim]`` caches: a row is the rank's slice of the heads). The other
    stores (DeepSeek's latent caches - MLA, V4's single KV head) are computed whole on every rank. A KV connector
    reads the slices each rank owns when the other instance runs another tensor_parallel_size (tp_slices.py)."""
    roots = [model] + ([proposer.module] if isinstance(getattr(proposer, "module", None), torch.nn.Module) else [])
    return {id(t): t.shape[1] for root in roots for m in root.modules() if isinstance(m, Attention)
            for t in (m.k_cache, m.v_cache) if t is not None}
