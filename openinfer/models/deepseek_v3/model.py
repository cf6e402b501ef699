"""DeepSeek-V3 (and R1, which shares the architecture), HF-shaped, over a flat token batch ``[T]``.

MLA attention over a paged latent cache (attention.py, ``layers/mla.py``), DeepSeekMoE after
``first_k_dense_replace`` dense layers (``layers/deepseek_moe.py``); config.py validates the fields, loading.py maps
checkpoint names (HF and DeepSeek's release, FP8 included) onto the parameters.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from openinfer.config import AttentionBackend
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.layers.attention import bind_layer_caches, free_layer_caches, FULL_ATTENTION_GROUP
from openinfer.layers.deepseek_moe import DeepseekMLP, DeepseekMoE
from openinfer.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from openinfer.layers.mla import MLAAttention
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import RotaryEmbedding
from openinfer.models.deepseek_v3.attention import DeepseekV3Attention
from openinfer.models.deepseek_v3.config import DeepseekV3Args
from openinfer.models.deepseek_v3.loading import load_v3_weights
from openinfer.models.interface import CausalLM, MTPLayer, ParallelMode


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, a: DeepseekV3Args, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = DeepseekV3Attention(a, backend)
        if a.is_moe_layer(layer_idx):
            self.mlp: nn.Module = DeepseekMoE(a.hidden_size, a.moe_intermediate_size, a.n_shared_experts,
                                              a.router, fp8_block=a.fp8_block)
        else:
            self.mlp = DeepseekMLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, residual, cos, sin):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DeepseekV3Model(nn.Module):
    def __init__(self, a: DeepseekV3Args, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(a, i, backend) for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        # One table for all layers (V3: 163840 positions), like HF's model-level rotary_emb.
        self.rotary_emb = RotaryEmbedding(a.qk_rope_head_dim, a.rope, a.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin)
        x, _ = self.norm(x, residual)
        return x


class DeepseekV3ForCausalLM(CausalLM):
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3")  # the latent cache in e4m3 (layers/mla.py)
    supported_quantization = ("int8", "int4", "w4a8")  # --quantization: linears and routed experts (quant_linear.py)
    # one-process tokens under tp2, dp2-ep2, tp2 x dp2 (V4), dp4-ep4: tests/test_deepseek_parallel.py
    supported_parallel_modes = frozenset({ParallelMode.TENSOR, ParallelMode.DATA, ParallelMode.EXPERT})

    @classmethod
    def mtp_layer_class(cls) -> type[MTPLayer]:
        from openinfer.models.deepseek_v3.mtp import DeepseekV3MTP  # its module imports this one

        return DeepseekV3MTP

    def __init__(self, cfg: dict[str, Any], *, attention_backend: AttentionBackend = AttentionBackend.SDPA) -> None:
        super().__init__()
        self.config = cfg
        self.args = DeepseekV3Args.from_hf(cfg)
        self.model = DeepseekV3Model(self.args, attention_backend)
        self.lm_head = ParallelLMHead(self.args.vocab_size, self.args.hidden_size)
        if self.args.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # -- latent KV cache -------------------------------------------------------------------------
    def attention_layers(self) -> list[MLAAttention]:
        return [layer.self_attn.mla for layer in self.model.layers]

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
        """One whole-life group: each layer's [c_kv | k_pe] latent per token."""
        elem = torch.empty((), dtype=dtype).element_size()
        return [KVGroupSpec(FULL_ATTENTION_GROUP,
                            block_size * elem * sum(a.latent_dim for a in self.attention_layers()))]

    def bind_kv_cache(self, num_blocks: Mapping[str, int], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        bind_layer_caches(self.attention_layers(), num_blocks, block_size, dtype, device)

    def free_kv_cache(self) -> None:
        free_layer_caches(self.attention_layers())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_v3_weights(self, weights)
