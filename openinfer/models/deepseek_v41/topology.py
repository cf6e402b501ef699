"""Cross-layer sharing (spec §7.2-7.4, DeepInfer ``v4_modules/cross_layer.py``): which layer's compressed KV,
indexer key projection and indexer top-k each layer reads, and where candidate blocks come from.

Each ``*_source_layer_ids`` list names the layers that compute a value; every later layer (up to the end of the
main model) reads the value of the nearest source at or before it. Layers before the first source compute their
own (they are sliding-window layers in every released config). Invariants checked here, as DeepInfer asserts
them, because a violation makes a layer read a store nobody wrote:
- a layer and its source have the same compress ratio (and a source of compressed KV is a compressed layer);
- the segments refine each other: index top-k within index-K within KV (a consumer's index keys come from its
  source's compressed KV);
- hence the first YOCO consumer layer (the first ratio-1 layer) starts its own KV segment;
- the candidate source computes its own top-k, and its candidate blocks hold at least ``index_topk`` entries.
"""
from __future__ import annotations

from dataclasses import dataclass


def source_map(source_ids: list[int], num_layers: int, field: str) -> tuple[int, ...]:
    """Per layer: the nearest source <= it, or the layer itself before the first source."""
    ids = sorted(set(source_ids))
    if not ids:
        raise ValueError(f"{field} must list at least one layer")
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{field} holds unknown layer ids {bad}: layers are 0..{num_layers - 1}")
    out = []
    for layer in range(num_layers):
        before = [s for s in ids if s <= layer]
        out.append(before[-1] if before else layer)
    return tuple(out)


@dataclass(frozen=True)
class SharedTopology:
    kv_source: tuple[int, ...]
    index_source: tuple[int, ...]
    index_k_source: tuple[int, ...]
    # Candidate blocks: the source layer (None: off), blocks kept per query and entries per block.
    candidate_source: int | None
    candidate_topk_blocks: int
    candidate_block_size: int
    # First ratio-1 layer: it and the later layers are YOCO consumers (== num layers when there is none).
    n_prefill_layer: int

    @classmethod
    def build(cls, ratios: tuple[int, ...], num_layers: int, kv_ids: list[int], index_ids: list[int],
              index_k_ids: list[int] | None, candidate_source: int | None, candidate_topk_blocks: int,
              candidate_block_size: int, index_topk: int) -> SharedTopology:
        kv = source_map(kv_ids, num_layers, "kv_source_layer_ids")
        index = source_map(index_ids, num_layers, "index_source_layer_ids")
        # DeepInfer's config defaults the index-K segments to the KV segments.
        index_k = source_map(kv_ids if index_k_ids is None else index_k_ids, num_layers,
                             "index_k_source_layer_ids")
        for field, m in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index),
                         ("index_k_source_layer_ids", index_k)):
            for layer, src in enumerate(m):
                if src != layer and ratios[src] != ratios[layer]:
                    raise ValueError(f"{field}: layer {layer} (compress ratio {ratios[layer]}) reads source "
                                     f"layer {src} (compress ratio {ratios[src]}); ratios must match")
            for layer in sorted(set(m)):
                if m[layer] == layer and ratios[layer] == 0 and any(s == layer and other != layer
                                                                    for other, s in enumerate(m)):
                    raise ValueError(f"{field}: source layer {layer} is sliding-window only (ratio 0)")
        for fine_name, fine, coarse_name, coarse in (("index_source_layer_ids", index, "index_k_source_layer_ids",
                                                      index_k),
                                                     ("index_k_source_layer_ids", index_k, "kv_source_layer_ids",
                                                      kv)):
            for layer, src in enumerate(fine):
                if coarse[src] != coarse[layer]:
                    raise ValueError(f"{fine_name}: layer {layer} reads source {src}, which lies in another "
                                     f"{coarse_name} segment ({coarse[src]} != {coarse[layer]})")
        # The ratio rule above already keeps KV sharing from crossing the YOCO boundary (the first ratio-1
        # layer cannot read a layer before it, all of which have other ratios).
        n_prefill = next((i for i, r in enumerate(ratios[:num_layers]) if r == 1), num_layers)
        if candidate_source is not None:
            if not 0 <= candidate_source < num_layers or index[candidate_source] != candidate_source:
                raise ValueError(f"candidate_source_layer_id={candidate_source} must be one of "
                                 f"index_source_layer_ids")
            if candidate_topk_blocks <= 0 or not 0 < candidate_block_size <= 16:
                raise ValueError(f"candidate_topk_blocks={candidate_topk_blocks} must be > 0 and "
                                 f"candidate_block_size={candidate_block_size} in 1..16")
            for layer in range(candidate_source, num_layers):
                if ratios[layer] != ratios[candidate_source]:
                    raise ValueError(f"layer {layer} follows candidate_source_layer_id={candidate_source} but "
                                     f"has compress ratio {ratios[layer]} != {ratios[candidate_source]}")
            if candidate_topk_blocks * candidate_block_size < index_topk:
                raise ValueError(f"candidate_topk_blocks * candidate_block_size = "
                                 f"{candidate_topk_blocks * candidate_block_size} < index_topk={index_topk}")
        return cls(kv, index, index_k, candidate_source, candidate_topk_blocks, candidate_block_size, n_prefill)

    def uses_candidates(self, layer: int) -> bool:
        """Restricts its own top-k to the candidate source's blocks (an index source after the candidate source)."""
        return (self.candidate_source is not None and layer > self.candidate_source
                and self.index_source[layer] == layer)

    def is_yoco_consumer(self, layer: int) -> bool:
        return layer >= self.n_prefill_layer
