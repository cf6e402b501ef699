"""DeepSeek-V4 (V4-Flash) decoder over a flat token batch, HF-shaped (spec §4.1).

  X = embed(ids) repeated on hc_mult streams
  per layer: x = hc_pre_attn(X); X = hc_post(attn(input_layernorm(x)), X)
             x = hc_pre_ffn(X);  X = hc_post(moe(post_attention_layernorm(x), ids), X)
  hidden = norm(hc_head(X)); logits = lm_head(hidden)
Each hc_post is fused with the following hc_pre (``fused_post_pre``), so the streams are read once per boundary.
``forward`` returns the streams X (what the MTP proposer reads, models/interface.py); ``compute_logits`` applies
hc_head, the norm and lm_head to the rows that need logits only.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from openinfer.config import AttentionBackend
from openinfer.forward_context import get_forward_context
from openinfer.layers.kv_quant import is_fp8
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.models.deepseek_v4.attention import DeepseekV4Attention
from openinfer.models.deepseek_v4.cache import (COARSE, FULL, WINDOW, StepIndex, V4LayerCache, coarse_ratio,
                                                layer_bytes_per_block, lookback_tokens)
from openinfer.layers.linear import CheckpointLinear
from openinfer.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from openinfer.layers.norm import RMSNorm
from openinfer.models.deepseek_v4.config import DeepseekV4Config
from openinfer.models.deepseek_v4.hc import HyperConnection, HyperHead, fused_post_pre, hc_post
from openinfer.models.deepseek_v4.moe import DeepseekV4MoE
from openinfer.models.interface import CausalLM, KVStores, MTPLayer, ParallelMode, module_kv_stores
from openinfer.layers.rotary import RotaryEmbedding



class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_idx: int,
                 backend: AttentionBackend = AttentionBackend.SDPA) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = DeepseekV4Attention(cfg, layer_idx, backend)
        self.mlp = DeepseekV4MoE(cfg, layer_idx)
        self.input_layernorm = RMSNorm(h, eps, torch.float32)
        self.post_attention_layernorm = RMSNorm(h, eps, torch.float32)
        self.attn_hc = HyperConnection(cfg.hc_mult, h, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.ffn_hc = HyperConnection(cfg.hc_mult, h, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)


class DeepseekV4MTPLayer(DeepseekV4DecoderLayer):
    """One multi-token-prediction block (spec §4.7). Weights only for now: speculative decoding comes later."""

    def __init__(self, cfg: DeepseekV4Config, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.e_proj = CheckpointLinear(h, h, bias=False)
        self.h_proj = CheckpointLinear(h, h, bias=False)
        self.enorm = RMSNorm(h, eps, torch.float32)
        self.hnorm = RMSNorm(h, eps, torch.float32)
        self.norm = RMSNorm(h, eps, torch.float32)
        self.hc_head = HyperHead(cfg.hc_mult, h, cfg.hc_eps, eps)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, backend: AttentionBackend = AttentionBackend.SDPA) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)  # no init: the checkpoint fills it
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(cfg, i, backend) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch.float32)
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps)
        self.rotary = nn.ModuleDict({name: RotaryEmbedding(r.rope_dim, r.params())
                                     for name, r in (("main", cfg.main_rope), ("compress", cfg.compress_rope))})
        self.coarse_tokens: int | None = None  # set with the KV cache (cache.coarse_ratio)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """-> the mHC streams X [T, hc_mult, D] after the last layer (``head`` turns them into hidden states)."""
        step = StepIndex.build(get_forward_context(), positions, self.coarse_tokens)
        rope = {name: rot.cos_sin(positions) for name, rot in self.rotary.items()}
        x = self.embed_tokens(input_ids)
        X = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        layers = self.layers
        x_in, post, comb = layers[0].attn_hc(X)
        for i, layer in enumerate(layers):
            y = layer.self_attn(layer.input_layernorm(x_in), step, rope)
            X, x_in, post, comb = fused_post_pre(y, X, post, comb, layer.ffn_hc)
            y = layer.mlp(layer.post_attention_layernorm(x_in), input_ids)
            if i + 1 < len(layers):
                X, x_in, post, comb = fused_post_pre(y, X, post, comb, layers[i + 1].attn_hc)
            else:
                X = hc_post(y, X, post, comb)
        return X

    def head(self, X: torch.Tensor) -> torch.Tensor:
        """Streams [T, hc_mult, D] -> the final hidden states [T, D]."""
        return self.norm(self.hc_head(X))


class DeepseekV4ForCausalLM(CausalLM):
    # fp8 on V4 is vLLM's fp8_ds_mla layout (cache.DS_MLA_STORES), as vLLM picks it for V4
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")
    # one-process tokens under tp2, dp2-ep2, tp2 x dp2 (V4), dp4-ep4: tests/test_deepseek_parallel.py
    supported_parallel_modes = frozenset({ParallelMode.TENSOR, ParallelMode.DATA, ParallelMode.EXPERT})

    @classmethod
    def mtp_layer_class(cls) -> type[MTPLayer]:
        from openinfer.models.deepseek_v4.mtp import DeepseekV4MTP  # runs the layers built here (self.mtp)

        return DeepseekV4MTP

    def __init__(self, hf_config: dict[str, Any], *,
                 attention_backend: AttentionBackend = AttentionBackend.SDPA) -> None:
        super().__init__()
        self.config = DeepseekV4Config.from_hf(hf_config)
        self.model = DeepseekV4Model(self.config, attention_backend)
        self.lm_head = ParallelLMHead(self.config.vocab_size, self.config.hidden_size)
        if self.config.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)
        # Built by load_weights only when the checkpoint carries mtp.* tensors (a V4-Flash MTP block is ~3% of
        # the model); None otherwise.
        self.mtp: nn.ModuleList | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.head(streams))

    def attention_layers(self) -> list[DeepseekV4Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def kv_stores(self) -> KVStores:
        """The target's stores. The MTP layers built with it (``self.mtp``) are bound by the MTP drafter, in its own
        ``mtp.*`` groups: it lists them (proposers/drafting.py), not the target."""
        return [st for child in self.children() if child is not self.mtp for st in module_kv_stores(child)]

    def build_mtp(self) -> nn.ModuleList:
        ref = self.lm_head.weight
        n = self.config.num_hidden_layers
        with torch.device(ref.device):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(ref.dtype)
            try:
                self.mtp = nn.ModuleList(DeepseekV4MTPLayer(self.config, n + i)
                                         for i in range(self.config.num_nextn_predict_layers))
            finally:
                torch.set_default_dtype(prev)
        return self.mtp

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from openinfer.models.deepseek_v4.loading import load_v4_weights

        return load_v4_weights(self, weights)

    # -- KV cache hooks (see cache.py for the layout) --------------------------------------------------
    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
        """Entry-level stores (read for the whole sequence) in the full group, token-level stores (read only
        within ``lookback_tokens`` of the query) in the window group, and the entries of a ratio spanning whole
        blocks (V4-Flash's HCA, m = 128) in a coarse group of one block per entry. Exact bytes per block; entry
        stores hold ceil(block_size / ratio) entries per block, so the full group is not linear in block_size."""
        elem = self.lm_head.weight.element_size()  # the model's dtype: ``dtype`` may be the fp8 cache's
        per_layer = [layer_bytes_per_block(self.config, i, block_size, elem, is_fp8(dtype))
                     for i in range(self.config.num_hidden_layers)]
        groups = [KVGroupSpec(FULL, sum(f for _, f, _ in per_layer)),
                  KVGroupSpec(WINDOW, sum(w for w, _, _ in per_layer),
                              lookback_tokens=lookback_tokens(self.config))]
        coarse = coarse_ratio(self.config, block_size)
        if coarse is not None:
            groups.append(KVGroupSpec(COARSE, sum(c for _, _, c in per_layer), block_tokens=coarse))
        return groups

    def bind_kv_cache(self, num_blocks: Mapping[str, int], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        self.model.coarse_tokens = coarse_ratio(self.config, block_size)
        for i, attn in enumerate(self.attention_layers()):
            attn.cache = V4LayerCache(self.config, i, num_blocks, block_size, self.lm_head.weight.dtype, device,
                                      kv_dtype=dtype)

    def free_kv_cache(self) -> None:
        for attn in self.attention_layers():
            attn.cache = None
