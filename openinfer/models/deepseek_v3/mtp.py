"""DeepSeek-V3's multi-token-prediction (MTP) layer, the drafter of its speculative decoding.

Checkpoint names ``model.layers.{num_hidden_layers + i}.*``: one full decoder block (MLA + MoE, the names of any
layer) plus ``enorm`` / ``hnorm`` / ``eh_proj`` and the layer's own ``embed_tokens`` and ``shared_head.{norm,head}``.
At position p it reads the target's final hidden state at p and the embedding of the token at p + 1, and predicts
the token at p + 2 (DeepSeek-V3 report, section 2.2):

    h' = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)]);  h'' = block(h');  logits = head(norm(h''))

Drafting k > 1 tokens reuses the layer with its own output h'' in place of the target's hidden state. Its KV (one
MLA latent per token) is an ordinary KV group of its own.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from openinfer.config import AttentionBackend
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.layers.attention import FULL_ATTENTION_GROUP, bind_layer_caches, free_layer_caches
from openinfer.layers.mla import MLAAttention
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import RotaryEmbedding
from openinfer.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from openinfer.models.deepseek_v3.config import DeepseekV3Args
from openinfer.models.deepseek_v3.loading import load_v3_weights
from openinfer.models.deepseek_v3.model import DeepseekV3DecoderLayer
from openinfer.models.interface import MTPLayer
from openinfer.models.weights import WeightLoadError


class SharedHead(nn.Module):
    def __init__(self, a: DeepseekV3Args) -> None:
        super().__init__()
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.head = ParallelLMHead(a.vocab_size, a.hidden_size)


class DeepseekV3MTP(DeepseekV3DecoderLayer, MTPLayer):
    """MTP layer ``index`` (0-based); its parameters are named as in the checkpoint after the
    ``model.layers.{num_hidden_layers + index}.`` prefix."""

    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3")  # its MLA latent cache, as the target's

    def __init__(self, cfg: dict[str, Any], index: int = 0, *,
                 attention_backend: AttentionBackend = AttentionBackend.SDPA) -> None:
        self.args = DeepseekV3Args.from_hf(cfg)
        n = int(cfg.get("num_nextn_predict_layers", 0) or 0)
        if not 0 <= index < n:
            raise ValueError(f"MTP layer {index} does not exist: num_nextn_predict_layers={n}")
        self.layer_idx = self.args.num_hidden_layers + index
        super().__init__(self.args, self.layer_idx, attention_backend)
        a = self.args
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size)
        self.enorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.hnorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * a.hidden_size, a.hidden_size, bias=False)
        self.shared_head = SharedHead(a)
        self.rotary_emb = RotaryEmbedding(a.qk_rope_head_dim, a.rope, a.max_position_embeddings)

    @property
    def checkpoint_prefix(self) -> str:
        return f"model.layers.{self.layer_idx}."

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                previous_hidden: torch.Tensor) -> torch.Tensor:
        """input_ids [T]: the token after each position; previous_hidden [T, H]: the target's (or this layer's)
        hidden state at each position. Returns this layer's hidden state [T, H] (before the shared head's norm)."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(input_ids)), self.hnorm(previous_hidden)], dim=-1))
        cos, sin = self.rotary_emb.cos_sin(positions)
        x, residual = super().forward(x, None, cos, sin)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden))

    # -- KV cache: one MLA latent per token, one group ------------------------------------------------------
    def attention_layers(self) -> list[MLAAttention]:
        return [self.self_attn.mla]

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
        elem = torch.empty((), dtype=dtype).element_size()
        return [KVGroupSpec(FULL_ATTENTION_GROUP, block_size * elem * self.self_attn.mla.latent_dim)]

    def bind_kv_cache(self, num_blocks: Mapping[str, int], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        bind_layer_caches(self.attention_layers(), num_blocks, block_size, dtype, device)

    def free_kv_cache(self) -> None:
        free_layer_caches(self.attention_layers())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tensors of this MTP layer (the rest of the checkpoint is skipped)."""
        prefix = self.checkpoint_prefix
        mine = ((name[len(prefix):], t) for name, t in weights if name.startswith(prefix))
        try:
            return load_v3_weights(self, mine)
        except WeightLoadError as e:
            raise WeightLoadError(f"MTP layer {prefix}*: {e}") from None
