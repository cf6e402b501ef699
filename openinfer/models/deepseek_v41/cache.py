"""Paged KV cache of DeepSeek-V4.1, on V4's two groups (``deepseek_v4/cache.py``: the same StepIndex, slots and
invariant - every piece of per-sequence state is paged and keyed by token position, so chunked prefill,
prefix-cache hits and preemption-by-recompute need nothing else).

window group, token-level rows ``[num_window_blocks, bs, width]``, read within ``lookback_tokens`` of a query:
  ``kv``    head_dim       every layer: its sliding-window latent (K == V)
  ``comp``  2*head_dim     C2 KV-source layers: the raw [kv | gate] rows, read when the pair's second token closes
  ``ids``   1 (int64)      the model's token ids, when Engram is on (its n-grams read N-1 tokens back)
full group, entry-level rows ``[num_blocks, bs/m, width]``, read for the whole sequence life:
  ``entries``     head_dim      KV-source layers only: compressed entry w (roped at w*m)
  ``index_keys``  index_dim     index-K source layers only
Cross-layer sharing is what makes V4.1 small: a layer that reads another layer's compressed KV or index keys
holds no store for them (it reads its source's). Entry w is written in the step that computes its last token
e = (w+1)*m - 1 and lives in the full-group block holding e (slot (e % bs) // m), as in V4.
"""
from __future__ import annotations

import torch

from openinfer.models.deepseek_v4.cache import FULL, WINDOW, StepIndex  # noqa: F401 (re-exported)
from openinfer.models.deepseek_v41.config import DeepseekV41Config

IDS_BYTES = 8  # int64 token id per token


def layer_store_widths(cfg: DeepseekV41Config, layer: int) -> tuple[dict[str, int], dict[str, int]]:
    """(token-level stores, entry-level stores) this layer owns: name -> width."""
    topo, d, ratio = cfg.topology, cfg.head_dim, cfg.ratio(layer)
    tok, ent = {"kv": d}, {}
    if ratio and topo.kv_source[layer] == layer:
        ent["entries"] = d
        if ratio == 2:
            tok["comp"] = 2 * d
    if ratio and topo.index_k_source[layer] == layer:
        ent["index_keys"] = cfg.index_head_dim
    return tok, ent


def lookback_tokens(cfg: DeepseekV41Config) -> int:
    """Window reads p - (W-1) .. p; a C2 entry closing at e reads row e - 1; Engram reads N - 1 ids back."""
    back = cfg.sliding_window - 1
    if 2 in cfg.compress_ratios[:cfg.num_hidden_layers]:
        back = max(back, 1)
    if cfg.engram is not None:
        back = max(back, cfg.engram.max_ngram_size - 1)
    return back


def check_block_size(cfg: DeepseekV41Config, block_size: int) -> None:
    if block_size % 2:
        raise ValueError(f"block_size={block_size} must be even: a C2 entry covers 2 tokens of one block")


def bytes_per_block(cfg: DeepseekV41Config, block_size: int, elem: int) -> tuple[int, int]:
    """(window-group, full-group) bytes per block over all layers (and the Engram id store)."""
    window = IDS_BYTES * block_size if cfg.engram is not None else 0
    full = 0
    for layer in range(cfg.num_hidden_layers):
        tok, ent = layer_store_widths(cfg, layer)
        window += elem * block_size * sum(tok.values())
        full += elem * (block_size // max(cfg.ratio(layer), 1)) * sum(ent.values())
    return window, full


class LayerCache:
    """One layer's own stores, attributes named like them."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, num_blocks: dict[str, int], block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.entry_cap = block_size // max(cfg.ratio(layer), 1)
        tok, ent = layer_store_widths(cfg, layer)
        self.names = list(tok) + list(ent)
        # The KV group whose blocks each store's first dimension indexes (what a KV connector transfers), as V4's.
        self.store_groups = {**{n: WINDOW for n in tok}, **{n: FULL for n in ent}}
        for name, width in tok.items():
            setattr(self, name, torch.zeros(num_blocks[WINDOW], block_size, width, dtype=dtype, device=device))
        for name, width in ent.items():
            setattr(self, name, torch.zeros(num_blocks[FULL], self.entry_cap, width, dtype=dtype, device=device))

    def flat(self, name: str) -> torch.Tensor:
        t = getattr(self, name)
        return t.view(-1, t.shape[-1])

    def stores(self) -> list[tuple[str, torch.Tensor]]:
        """(KV group, store) per store, in ``names`` order: what ``kv_stores`` reports (a KV connector's tensors)."""
        return [(self.store_groups[name], getattr(self, name)) for name in self.names]
