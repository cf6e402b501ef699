"""DeepSeek-V4.1 decoder over a flat token batch (spec §7), HF-shaped:

  X = embed(ids) on hc_mult streams; pre = one-hot stream 0
  per layer: [Engram gate on X]; (pre', post, comb) = attn_hc.mixes(X); x = attn_norm(apply(pre, X));
             X = hc_post(attn(x), X, post, comb); pre = pre'; the same around the MoE with ffn_hc
  hidden = norm(apply(pre, X)); logits = head(hidden)          (shifted mHC: no hc_head)
``forward`` returns the normed hidden states; ``compute_logits`` applies the head to the rows that need it.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from openinfer.config import AttentionBackend
from openinfer.forward_context import get_forward_context
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import RotaryEmbedding
from openinfer.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from openinfer.models.deepseek_v41.attention import Attention, StepState
from openinfer.models.deepseek_v41.cache import (FULL, KV_CACHE_DTYPES, WINDOW, KVNumerics, LayerCache, StepIndex,
                                                 bytes_per_block, check_block_size, layout_summary, lookback_tokens)
from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.deepseek_v41.dspark import DSparkDrafter, draft_positions, target_features
from openinfer.models.deepseek_v41.engram import Engram, compressed_vocabulary, table_sizes
from openinfer.models.deepseek_v41.hc import ShiftedHyperConnection, apply_pre, first_pre, hc_post
from openinfer.models.deepseek_v41.moe import MoE
from openinfer.models.deepseek_v41.vision import VisionTower, VisionTowerConfig
from openinfer.models.deepseek_v41.vision_inputs import ImageEmbedder
from openinfer.models.interface import DSparkShape, DSparkTarget, KVStoreOwner, KVStores, ParallelMode
from openinfer.step_io import MMImage

logger = logging.getLogger(__name__)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV41Config, layer: int, engram_sizes: list[int] | None,
                 lookup: torch.Tensor | None = None) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer)
        self.mlp = MoE(cfg)
        self.input_layernorm = RMSNorm(h, eps, torch.float32)
        self.post_attention_layernorm = RMSNorm(h, eps, torch.float32)
        self.attn_hc = ShiftedHyperConnection(cfg.hc_mult, h, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.ffn_hc = ShiftedHyperConnection(cfg.hc_mult, h, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.engram = (Engram(cfg.engram, layer, h, cfg.hc_mult, eps, engram_sizes, lookup)
                       if engram_sizes is not None else None)


class DeepseekV41Model(nn.Module, KVStoreOwner):
    def __init__(self, cfg: DeepseekV41Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        sizes = table_sizes(cfg.engram) if cfg.engram is not None else {}
        lookup = None
        if cfg.engram is not None and cfg.engram.tokenizer_file is not None:
            lookup = compressed_vocabulary(cfg.engram.tokenizer_file, cfg.engram.tokenizer_vocab_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, sizes.get(i), lookup)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch.float32)
        self.rotary = nn.ModuleDict({name: RotaryEmbedding(r.rope_dim, r.params())
                                     for name, r in (("main", cfg.main_rope), ("compress", cfg.compress_rope))})
        self.ids_store: torch.Tensor | None = None  # Engram's token ids, window-group blocks
        # DSpark: when set, forward keeps the target layers' attention inputs ([T, targets*D], dspark.py)
        self.capture_dspark_features = False
        self.dspark_features: torch.Tensor | None = None

    def kv_stores(self) -> KVStores:
        """Engram's token ids travel with the window group (a decoder's Engram reads N-1 ids back)."""
        return [] if self.ids_store is None else [(WINDOW, self.ids_store)]

    def rope(self, positions: torch.Tensor) -> dict:
        rope: dict[str, Any] = {name: rot.cos_sin(positions) for name, rot in self.rotary.items()}
        rope.update({f"{name}_fn": rot._compute for name, rot in self.rotary.items()})
        return rope

    def history(self, input_ids: torch.Tensor, step: StepIndex) -> torch.Tensor | None:
        """[T, N] ids: column k = the id k positions back (Engram's pad before the start), via the id store."""
        if self.cfg.engram is None:
            return None
        slot_mapping = get_forward_context().group(WINDOW).slot_mapping
        flat = self.ids_store.view(-1)
        flat.index_copy_(0, slot_mapping, input_ids.long())
        back = step.positions[:, None] - torch.arange(self.cfg.engram.max_ngram_size, device=input_ids.device)
        ids = flat[step.token_slots(step.token_seq[:, None], back)]
        return torch.where(back >= 0, ids, self.cfg.engram.pad_token_id)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        md = get_forward_context()
        step = StepIndex.build(md, positions)
        rope = self.rope(positions)
        history = self.history(input_ids, step)
        state = StepState([layer.self_attn.cache for layer in self.layers])
        x = self.embed_tokens(input_ids)
        if md.mm_rows is not None:  # image positions: the vision tower's embeddings (vision_inputs.py)
            x = x.index_copy(0, md.mm_rows, md.mm_embeds.to(x.dtype))
        image_rows = md.image_rows
        X = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        pre = first_pre(x.shape[0], self.cfg.hc_mult, x.device)
        targets = self.cfg.dspark.target_layer_ids if self.capture_dspark_features else ()
        captured = []
        boundary = self.cfg.topology.n_prefill_layer
        keeps = self.consumer_rows(md, step)
        for i, layer in enumerate(self.layers):
            if keeps is not None and i >= boundary:
                if i == boundary:  # every row: consumer kv sources compress it
                    state.shared_hidden = layer.input_layernorm(apply_pre(pre, X))
                    state.full_step = step
                sel = keeps[i - boundary] if state.rows is None else keeps[i - boundary][state.rows]
                if not bool(sel.all()):
                    sel = sel.nonzero().squeeze(1)
                    X, pre, step, rope, history = _select_rows(sel, X, pre, step, rope, history, state)
            if layer.engram is not None:
                X = layer.engram(X, history)
            if i in targets:
                captured.append(X)
            nxt, post, comb = layer.attn_hc.mixes(X)
            h = layer.input_layernorm(apply_pre(pre, X))
            if i == boundary and keeps is None:
                state.shared_hidden = h
            X, pre = hc_post(layer.self_attn(h, step, rope, state), X, post, comb), nxt
            nxt, post, comb = layer.ffn_hc.mixes(X)
            images = image_rows if image_rows is None or state.rows is None else image_rows[state.rows]
            y = layer.mlp(layer.post_attention_layernorm(apply_pre(pre, X)), image_rows=images)
            X, pre = hc_post(y, X, post, comb), nxt
        if captured:
            self.dspark_features = target_features(captured)
        out = self.norm(apply_pre(pre, X))
        if state.rows is None:
            return out
        full = out.new_zeros(positions.shape[0], out.shape[1])  # rows nobody reads stay zero
        full[state.rows] = out
        return full

    def consumer_rows(self, md, step: StepIndex) -> list[torch.Tensor] | None:
        """YOCO shortened prefill, exact: per consumer layer c (0 = the boundary, L of them), which of the step's
        rows it must compute, or None for all. A consumer layer's window KV comes from its own input, so the rows
        needed are a trailing run per sequence of this step:
          - the last consumer layer: the read row (the sequence's last in this step) and its window, W rows, or
            the W - 1 rows later steps read from the window cache when nothing is read this step;
          - each earlier layer: W - 1 more, the windows of the rows the next layer computes;
        i.e. rows with (last position - position) < (L - c)(W - 1) + [the sequence's last row is read]. The rows
        near the start of a run attend over rows this layer skipped; their outputs feed nothing (the next layer
        drops them), while their KV, a function of their own input only, is exact. Compressed KV past the
        boundary comes from the shared hidden, computed for every row. Off (None) when every row is read, when
        nothing says which rows are read (``output_rows``: the runner gives none with prefix caching, since a
        request resuming at any full block reads the window rows before it, nor with a proposer or prompt
        logprobs), for the DSpark feature capture, or with Engram past the boundary (as DeepInfer's compaction).
        DeepInfer's own bounded replay (``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS``) is approximate instead: it keeps a
        fixed suffix and narrows the kept rows' windows to it."""
        cfg = self.cfg
        consumers = cfg.num_hidden_layers - cfg.topology.n_prefill_layer
        out = md.output_rows
        if (out is None or not md.prefills or consumers <= 0 or cfg.sliding_window < 2
                or self.capture_dspark_features or cfg.engram is not None
                and any(i >= cfg.topology.n_prefill_layer for i in cfg.engram.layer_ids)):
            return None
        seq, pos = step.token_seq, step.positions
        last = torch.full((int(seq.max()) + 1,), -1, dtype=pos.dtype, device=pos.device)
        last = last.scatter_reduce(0, seq, pos, "amax")
        if out.numel() and not bool((pos[out] == last[seq[out]]).all()):
            return None  # a read row that is not its sequence's last: not this shape
        read = torch.zeros_like(last)
        read[seq[out]] = 1
        back, extra = last[seq] - pos, read[seq]
        keeps = [back < (consumers - c) * (cfg.sliding_window - 1) + extra for c in range(consumers)]
        return None if bool(keeps[-1].all()) else keeps  # the last layer keeps the fewest


def _select_rows(sel: torch.Tensor, X, pre, step: StepIndex, rope: dict, history, state: StepState):
    """Keep rows ``sel`` of the current ones: the streams, the step's index and RoPE, Engram's history and the
    per-row values source layers left for later ones (top-k, candidate blocks)."""
    rope = {k: v if k.endswith("_fn") else (v[0][sel], v[1][sel]) for k, v in rope.items()}
    step = dataclasses.replace(step, token_seq=step.token_seq[sel], positions=step.positions[sel])
    state.topk = {k: v[sel] for k, v in state.topk.items()}
    if state.candidates is not None:
        state.candidates = state.candidates[sel]
    state.rows = sel if state.rows is None else state.rows[sel]
    return X[sel], pre[sel], step, rope, history[sel] if history is not None else None


class DeepseekV41ForCausalLM(DSparkTarget):
    # Replicas, and DeepseekMoE's experts over expert-parallel ranks (one-process tokens, dp2-ep2). Not tensor
    # parallel: attention is replicated and load_v41_weights does not shard the embedding / head (tp2 failed at
    # load with "embed.weight has shape (256, 128), the model expects (128, 128)").
    supported_parallel_modes = frozenset({ParallelMode.DATA, ParallelMode.EXPERT})
    # DeepInfer's layouts (cache.KVNumerics): fp8 as DeepInfer runs this config, fp4 / mxfp8 its two entry formats.
    supported_kv_cache_dtypes = KV_CACHE_DTYPES

    def __init__(self, hf_config: dict[str, Any], *,
                 attention_backend: AttentionBackend = AttentionBackend.SDPA) -> None:
        super().__init__()
        self.config = DeepseekV41Config.from_hf(hf_config)
        self.model = DeepseekV41Model(self.config)
        self.lm_head = ParallelLMHead(self.config.vocab_size, self.config.hidden_size)
        if self.config.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)
        # The DSpark draft blocks, built by load_weights when the checkpoint carries mtp.* tensors.
        self.mtp: DSparkDrafter | None = None
        self.kv_numerics = KVNumerics()
        # The vision tower, for a checkpoint with vision_config unless text-only serving was asked for
        # (--limit-mm-per-prompt '{"image": 0}': the config then carries _text_only and its weights are skipped).
        self.vision: ImageEmbedder | None = None
        if self.config.vision is not None and not hf_config.get("_text_only"):
            tower = VisionTower(VisionTowerConfig.from_hf(hf_config["vision_config"], self.config.hidden_size))
            self.vision = ImageEmbedder(tower)

    def embed_image(self, image: MMImage) -> torch.Tensor:
        """[image.length, hidden]: the embeddings of one image's prompt positions (markers included)."""
        if self.vision is None:
            raise ValueError("this model was loaded without its vision tower (text-only serving)")
        return self.vision(image)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def build_mtp(self) -> DSparkDrafter:
        ref = self.lm_head.weight
        prev = torch.get_default_dtype()
        torch.set_default_dtype(ref.dtype)
        try:
            with torch.device(ref.device):
                self.mtp = DSparkDrafter(self.config)
        finally:
            torch.set_default_dtype(prev)
        return self.mtp

    def dspark_shape(self) -> DSparkShape:
        cfg = self.config
        return DSparkShape(draft_blocks=0 if self.mtp is None else len(self.mtp),
                           declared_blocks=cfg.num_nextn_predict_layers,
                           max_draft_tokens=cfg.dspark.block_size if cfg.dspark is not None else 0,
                           key_dim=cfg.head_dim, window=cfg.sliding_window)

    def capture_dspark_features(self, on: bool) -> None:
        self.model.capture_dspark_features = on

    def dspark_features(self) -> torch.Tensor | None:
        return self.model.dspark_features

    def propose(self, features: torch.Tensor, ctx_pos: torch.Tensor, golden: torch.Tensor,
                block_size: int | None = None, draw=None):
        """DSpark drafts after the accepted tokens whose target features are ``features`` (dspark.py)."""
        return self.mtp.propose(features, ctx_pos, golden, self.model.embed_tokens, self.lm_head,
                                self.model.rotary["main"], block_size=block_size, draw=draw)

    def dspark_context_positions(self, accepted: torch.Tensor, window: int, k: int) -> torch.Tensor:
        return draft_positions(accepted, window, k)[0]

    def dspark_context_keys(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N, targets*D] target features of tokens at ``positions`` -> their draft-block keys [N, blocks, d]."""
        return self.mtp.context_keys(features, positions, self.model.rotary["main"])

    def propose_over_keys(self, keys: torch.Tensor, ctx_pos: torch.Tensor, golden: torch.Tensor,
                          block_size: int | None = None, draw=None):
        """``propose`` over paged context keys [B, W, blocks, d] (``dspark_context_keys``)."""
        return self.mtp.propose_over_keys(keys, ctx_pos, golden, self.model.embed_tokens, self.lm_head,
                                          self.model.rotary["main"], block_size=block_size, draw=draw)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from openinfer.models.deepseek_v41.loading import load_v41_weights

        return load_v41_weights(self, weights)

    # -- KV cache hooks (cache.py) -----------------------------------------------------------------------
    def use_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """Pick the stores' layouts (cache.KVNumerics) and log them with their bytes per token."""
        self.kv_numerics = KVNumerics.build(self.config, kv_cache_dtype)
        logger.info(layout_summary(self.config, self._dtype.itemsize, self.kv_numerics))

    @property
    def _dtype(self) -> torch.dtype:
        """The model's dtype (the store dtype the runner hands over is float8 for any quantised kv_cache_dtype)."""
        return self.model.embed_tokens.weight.dtype

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
        """Entries and index keys (whole life) in the full group; windows, C2 rows and Engram ids (read within
        ``lookback_tokens``) in the window group. Exact bytes per block."""
        check_block_size(self.config, block_size)
        window, full = bytes_per_block(self.config, block_size, self._dtype.itemsize, self.kv_numerics)
        return [KVGroupSpec(FULL, full), KVGroupSpec(WINDOW, window, lookback_tokens=lookback_tokens(self.config))]

    def bind_kv_cache(self, num_blocks: Mapping[str, int], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        for i, attn in enumerate(self.attention_layers()):
            attn.cache = LayerCache(self.config, i, dict(num_blocks), block_size, self._dtype, device,
                                    self.kv_numerics)
        if self.config.engram is not None:
            self.model.ids_store = torch.zeros(num_blocks[WINDOW], block_size, dtype=torch.long, device=device)

    def free_kv_cache(self) -> None:
        for attn in self.attention_layers():
            attn.cache = None
        self.model.ids_store = None
