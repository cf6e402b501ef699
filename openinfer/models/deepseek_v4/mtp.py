"""DeepSeek-V4's multi-token-prediction layer as a drafter (spec section 4.7).

The layer itself (``mtp.{i}.*``: e_proj / h_proj, enorm / hnorm, a sliding-window-only decoder block with its own
mHC, its own hc_head and norm) is loaded with the target (``DeepseekV4ForCausalLM.mtp``); this module runs it and
shares the target's embedding, LM head and rotary tables rather than holding copies. At position p it reads the
target's final mHC streams at p (before hc_head) and the token at p + 1, and predicts p + 2:

    e = embed(t_{p+1}) (0 at position 0);  X0 = h_proj(hnorm(X_p)) + e_proj(enorm(e))
    X1 = block(X0);  logits = lm_head(norm(hc_head(X1)))

Feeding X1 back as the streams drafts k > 1. Its window / entry stores are KV groups of its own.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from openinfer.forward_context import get_forward_context
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.layers.kv_quant import is_fp8
from openinfer.models.deepseek_v4.cache import (COARSE, FULL, WINDOW, StepIndex, V4LayerCache, coarse_ratio,
                                                layer_bytes_per_block, lookback_tokens)
from openinfer.models.deepseek_v4.hc import fused_post_pre, hc_post
from openinfer.models.interface import MTPLayer


class DeepseekV4MTP(MTPLayer):
    # Built from the loaded target (its mtp layers, embedding and head), not from the checkpoint again.
    shares_target = True
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")  # its stores, as the target's

    def __init__(self, target: nn.Module, index: int = 0) -> None:
        super().__init__()
        if target.mtp is None or not 0 <= index < len(target.mtp):
            raise ValueError(f"speculative_config.method='mtp': the checkpoint has no MTP layer mtp.{index}.* "
                             f"(num_nextn_predict_layers={target.config.num_nextn_predict_layers})")
        self.cfg = target.config
        self.layer = target.mtp[index]
        self.layer_idx = self.cfg.num_hidden_layers + index
        # Shared, not owned: a plain attribute keeps them out of this module's parameters.
        self.__dict__["_target"] = target
        self.coarse_tokens: int | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """input_ids [T]: the token after each position; streams [T, hc_mult, D]: the target's (or this layer's)
        streams at each position. Returns this layer's streams [T, hc_mult, D]."""
        t, L = self._target, self.layer
        step = StepIndex.build(get_forward_context(), positions, self.coarse_tokens)
        rope = {name: rot.cos_sin(positions) for name, rot in t.model.rotary.items()}
        e = t.model.embed_tokens(input_ids)
        e = e.masked_fill((positions == 0)[:, None], 0.0)
        n, d = streams.shape[1], streams.shape[2]
        h = L.h_proj(L.hnorm(streams).reshape(-1, d)).view(-1, n, d)
        X = (h + L.e_proj(L.enorm(e))[:, None, :]).to(streams.dtype)
        x_in, post, comb = L.attn_hc(X)
        y = L.self_attn(L.input_layernorm(x_in), step, rope)
        X, x_in, post, comb = fused_post_pre(y, X, post, comb, L.ffn_hc)
        y = L.mlp(L.post_attention_layernorm(x_in), input_ids)
        return hc_post(y, X, post, comb)

    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self._target.lm_head(self.layer.norm(self.layer.hc_head(streams)))

    # -- KV cache: the MTP layer's stores, groups like the target's --------------------------------------------
    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
        elem = self._target.lm_head.weight.element_size()  # the model's dtype: ``dtype`` may be the fp8 cache's
        window, full, coarse = layer_bytes_per_block(self.cfg, self.layer_idx, block_size, elem, is_fp8(dtype))
        groups = [KVGroupSpec(FULL, full), KVGroupSpec(WINDOW, window, lookback_tokens=lookback_tokens(self.cfg))]
        ratio = coarse_ratio(self.cfg, block_size)
        if ratio is not None:
            groups.append(KVGroupSpec(COARSE, coarse, block_tokens=ratio))
        return groups

    def bind_kv_cache(self, num_blocks: Mapping[str, int], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        self.coarse_tokens = coarse_ratio(self.cfg, block_size)
        self.layer.self_attn.cache = V4LayerCache(self.cfg, self.layer_idx, num_blocks, block_size,
                                                  self._target.lm_head.weight.dtype, device, kv_dtype=dtype)

    def free_kv_cache(self) -> None:
        self.layer.self_attn.cache = None
