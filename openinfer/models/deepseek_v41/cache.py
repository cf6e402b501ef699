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

DeepInfer's numerics (``KVNumerics``; ``--kv-cache-dtype``, names as DeepInfer's start-up line "Main KV: FP4 |
MXFP8; Indexer QK: FP4"): the ``kv`` window in MXFP8, the compressed ``entries`` in FP4 (e2m1 + an e4m3 scale
per 16) or MXFP8, the ``index_keys`` (and the indexer's queries) in FP4 with a UE8M0 scale per 32
(``layers/kv_mx.py``). The raw C2 ``comp`` rows and the Engram ids keep the model's dtype (DeepInfer keeps its
compression state in fp32).
  fp8 / fp8_e4m3   what DeepInfer runs for this config: entries FP4 if ``use_fp4_sparse_kv`` (its default) else MXFP8
  fp4              entries FP4 whatever the config says
  mxfp8            entries MXFP8 whatever the config says
  auto             every store in the model's dtype (``use_fp4_sparse_kv`` not applied: logged at start-up)
V4.1-Flash (block 16): bf16 3,200 B/token for a sequence's life; fp8 / fp4 890 (entries 3 x 288 / 2 + 288 at
the KV sources 2, 8, 14, 20, index keys 3 x 68 / 2 + 68 at the same index-K sources), mxfp8 1,490 (528-B entries):
DeepInfer's per-entry figures (its ``_kv_bytes_per_token`` / ``_get_qk_topk_bytes``,
tests/test_deepseek_v41_kv_numerics.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from openinfer.layers.kv_mx import MxFormat, fp4_index, fp4_main, mxfp8
from openinfer.layers.kv_quant import PackedRows
from openinfer.models.deepseek_v4.cache import FULL, WINDOW, StepIndex  # noqa: F401 (re-exported)
from openinfer.models.deepseek_v41.config import DeepseekV41Config

IDS_BYTES = 8  # int64 token id per token
# --kv-cache-dtype values with DeepInfer's layouts (see the module docstring); "auto" keeps the model's dtype.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp4", "mxfp8")


@dataclass(frozen=True)
class KVNumerics:
    """How each store is packed: None keeps the model's dtype."""

    kv_cache_dtype: str = "auto"
    kv: MxFormat | None = None
    entries: MxFormat | None = None
    index_keys: MxFormat | None = None

    @classmethod
    def build(cls, cfg: DeepseekV41Config, kv_cache_dtype: str) -> KVNumerics:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported by DeepSeek-V4.1; it supports "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if kv_cache_dtype == "auto":
            return cls()
        fp4 = kv_cache_dtype == "fp4" or kv_cache_dtype != "mxfp8" and cfg.use_fp4_sparse_kv
        d = cfg.head_dim
        return cls(kv_cache_dtype, kv=mxfp8(d), entries=fp4_main(d) if fp4 else mxfp8(d),
                   index_keys=fp4_index(cfg.index_head_dim))

    def layout(self, name: str) -> MxFormat | None:
        return getattr(self, name, None) if name in ("kv", "entries", "index_keys") else None


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


def _row_bytes(numerics: KVNumerics, name: str, width: int, elem: int) -> int:
    layout = numerics.layout(name)
    return layout.row_bytes if layout is not None else elem * width


def bytes_per_block(cfg: DeepseekV41Config, block_size: int, elem: int,
                    numerics: KVNumerics = KVNumerics()) -> tuple[int, int]:
    """(window-group, full-group) bytes per block over all layers (and the Engram id store)."""
    window = IDS_BYTES * block_size if cfg.engram is not None else 0
    full = 0
    for layer in range(cfg.num_hidden_layers):
        tok, ent = layer_store_widths(cfg, layer)
        window += block_size * sum(_row_bytes(numerics, n, w, elem) for n, w in tok.items())
        full += (block_size // max(cfg.ratio(layer), 1)) * sum(_row_bytes(numerics, n, w, elem) for n, w in ent.items())
    return window, full


def store_bytes_per_token(cfg: DeepseekV41Config, elem: int, numerics: KVNumerics) -> dict[str, Fraction]:
    """Bytes per token of each kind of store over all layers that own one (an entry of a ratio-m layer covers m
    tokens), keyed like the stores; ``ids``: Engram's token ids."""
    out: dict[str, Fraction] = {}
    for layer in range(cfg.num_hidden_layers):
        tok, ent = layer_store_widths(cfg, layer)
        for n, w in tok.items():
            out[n] = out.get(n, Fraction(0)) + _row_bytes(numerics, n, w, elem)
        for n, w in ent.items():
            out[n] = out.get(n, Fraction(0)) + Fraction(_row_bytes(numerics, n, w, elem), max(cfg.ratio(layer), 1))
    if cfg.engram is not None:
        out["ids"] = Fraction(IDS_BYTES)
    return out


def _fmt(b: Fraction) -> str:
    return str(b.numerator) if b.denominator == 1 else f"{float(b):.1f}"


def layout_summary(cfg: DeepseekV41Config, elem: int, numerics: KVNumerics) -> str:
    """The start-up line: each store's layout and bytes per token, per KV group and in total."""
    per = store_bytes_per_token(cfg, elem, numerics)
    parts = {}
    for group, names in ((FULL, ("entries", "index_keys")), (WINDOW, ("kv", "comp", "ids"))):
        items = []
        for n in names:
            if n in per:
                layout = numerics.layout(n)
                kind = layout.name if layout is not None else ("int64" if n == "ids" else f"{elem * 8}-bit")
                items.append(f"{n} {kind} {_fmt(per[n])}")
        parts[group] = (sum((per[n] for n in names if n in per), Fraction(0)), items)
    full, window = parts[FULL], parts[WINDOW]
    fp4_note = "" if numerics.kv_cache_dtype != "auto" or not cfg.use_fp4_sparse_kv else (
        "; config.json's use_fp4_sparse_kv (DeepInfer: FP4 compressed KV) is not applied under kv_cache_dtype=auto "
        "- --kv-cache-dtype fp8 runs DeepInfer's layouts")
    return (f"DeepSeek-V4.1 KV layout (kv_cache_dtype={numerics.kv_cache_dtype}, use_fp4_sparse_kv="
            f"{str(cfg.use_fp4_sparse_kv).lower()}), bytes/token: full group {_fmt(full[0])} "
            f"({', '.join(full[1])}) for a sequence's life; window group {_fmt(window[0])} "
            f"({', '.join(window[1])}) within the lookback{fp4_note}")


class LayerCache:
    """One layer's own stores, attributes named like them. ``dtype``: the model's; a store ``numerics`` packs is
    uint8 records, read and written through ``flat`` as if it held ``dtype`` rows."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, num_blocks: dict[str, int], block_size: int,
                 dtype: torch.dtype, device: torch.device, numerics: KVNumerics = KVNumerics()) -> None:
        self.entry_cap = block_size // max(cfg.ratio(layer), 1)
        self.dtype, self.numerics = dtype, numerics
        tok, ent = layer_store_widths(cfg, layer)
        self.names = list(tok) + list(ent)
        # The KV group whose blocks each store's first dimension indexes (what a KV connector transfers), as V4's.
        self.store_groups = {**{n: WINDOW for n in tok}, **{n: FULL for n in ent}}
        for name, width in tok.items():
            setattr(self, name, self._store(name, (num_blocks[WINDOW], block_size), width, device))
        for name, width in ent.items():
            setattr(self, name, self._store(name, (num_blocks[FULL], self.entry_cap), width, device))

    def _store(self, name: str, lead: tuple[int, int], width: int, device: torch.device) -> torch.Tensor:
        layout = self.numerics.layout(name)
        if layout is not None:
            return torch.zeros(*lead, layout.row_bytes, dtype=torch.uint8, device=device)
        return torch.zeros(*lead, width, dtype=self.dtype, device=device)

    def flat(self, name: str) -> torch.Tensor | PackedRows:
        """[slots, width] rows of store ``name`` (indexing a packed store dequantises the rows picked, writing packs)."""
        t = getattr(self, name)
        rows = t.view(-1, t.shape[-1])
        layout = self.numerics.layout(name)
        return rows if layout is None else PackedRows(rows, layout, self.dtype)

    def stores(self) -> list[tuple[str, torch.Tensor]]:
        """(KV group, store) per store, in ``names`` order: what ``kv_stores`` reports (a KV connector's tensors)."""
        return [(self.store_groups[name], getattr(self, name)) for name in self.names]
