"""DeepSeek-V3 (and R1, which shares the architecture), HF-shaped, over a flat token batch ``[T]``.

MLA attention over a paged latent cache (``layers/mla.py``), DeepSeekMoE after ``first_k_dense_replace`` dense
layers (``layers/deepseek_moe.py``). Loads HF checkpoints as transformers writes them and as DeepSeek releases
them: per-expert tensors are stacked for the grouped-matmul MoE, FP8 block-quantised weights are dequantised
at load, and MTP layers (``model.layers.{num_hidden_layers}.*``) are skipped.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from openinfer.config import AttentionBackend
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.layers.attention import FULL_ATTENTION_GROUP

from openinfer.layers.deepseek_moe import DeepseekExperts, DeepseekMLP, DeepseekMoE, RouterConfig
from openinfer.layers.fp8 import FP8_DTYPE, dequantize_fp8_block, fp8_block_size
from openinfer.layers.mla import DeepseekRotaryEmbedding, MLAAttention, apply_rope, softmax_scale
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import rope_parameters
from openinfer.models.weights import WeightLoadError, copy_into

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# The small norms inside MLA use DeepSeek's default eps, not rms_norm_eps (HF and DeepSeek's code agree).
_LORA_NORM_EPS = 1e-6


def _positive_int(cfg: dict[str, Any], field: str, default: int | None = None) -> int:
    value = cfg.get(field, default)
    if value is None:
        raise ValueError(f"config field {field!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config field {field}={value!r} must be a positive int")
    return value


@dataclass(frozen=True)
class DeepseekV3Args:
    """The config.json fields this model uses, validated at construction (errors name the field)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    first_k_dense_replace: int
    moe_intermediate_size: int
    n_shared_experts: int
    router: RouterConfig | None  # None: every layer is dense
    rms_norm_eps: float
    max_position_embeddings: int
    attention_bias: bool
    rope_interleave: bool
    rope: dict[str, Any]
    tie_word_embeddings: bool
    fp8_block: tuple[int, int] | None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> DeepseekV3Args:
        num_layers = _positive_int(cfg, "num_hidden_layers")
        q_lora = cfg.get("q_lora_rank")
        if q_lora is not None:
            q_lora = _positive_int(cfg, "q_lora_rank")
        rope_dim = _positive_int(cfg, "qk_rope_head_dim")
        if rope_dim % 2:
            raise ValueError(f"config field qk_rope_head_dim={rope_dim} must be even")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config field hidden_act={cfg['hidden_act']!r} is not supported "
                             "(supported: silu)")
        first_dense = cfg.get("first_k_dense_replace") or 0
        if not isinstance(first_dense, int) or first_dense < 0:
            raise ValueError(f"config field first_k_dense_replace={first_dense!r} must be an int >= 0")
        if cfg.get("moe_layer_freq", 1) != 1:
            raise ValueError(f"config field moe_layer_freq={cfg['moe_layer_freq']!r} is not supported "
                             "(only 1)")
        has_moe = bool(cfg.get("n_routed_experts")) and first_dense < num_layers
        rope = rope_parameters(cfg)
        if rope["rope_type"] not in ("default", "yarn"):
            raise ValueError(f"config field rope_scaling/rope_parameters type {rope['rope_type']!r} is not "
                             "supported (supported: default, yarn)")
        return cls(
            vocab_size=_positive_int(cfg, "vocab_size"),
            hidden_size=_positive_int(cfg, "hidden_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=_positive_int(cfg, "num_attention_heads"),
            q_lora_rank=q_lora,
            kv_lora_rank=_positive_int(cfg, "kv_lora_rank"),
            qk_nope_head_dim=_positive_int(cfg, "qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim,
            v_head_dim=_positive_int(cfg, "v_head_dim"),
            intermediate_size=_positive_int(cfg, "intermediate_size") if first_dense or not has_moe else 0,
            first_k_dense_replace=first_dense,
            moe_intermediate_size=_positive_int(cfg, "moe_intermediate_size") if has_moe else 0,
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            router=RouterConfig.from_hf(cfg) if has_moe else None,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=_positive_int(cfg, "max_position_embeddings", 2048),
            attention_bias=bool(cfg.get("attention_bias", False)),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            rope=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            fp8_block=fp8_block_size(cfg),
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.router is not None and layer_idx >= self.first_k_dense_replace


class DeepseekV3Attention(nn.Module):
    def __init__(self, a: DeepseekV3Args, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = a.num_attention_heads
        self.q_lora_rank = a.q_lora_rank
        self.kv_lora_rank = a.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = a.qk_nope_head_dim, a.qk_rope_head_dim
        self.rope_interleave = a.rope_interleave
        qk_head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank is None:
            self.q_proj = nn.Linear(a.hidden_size, self.num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(a.hidden_size, a.q_lora_rank, bias=a.attention_bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(a.q_lora_rank, self.num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(a.hidden_size, a.kv_lora_rank + a.qk_rope_head_dim,
                                            bias=a.attention_bias)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(a.kv_lora_rank, self.num_heads * (a.qk_nope_head_dim + a.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.num_heads * a.v_head_dim, a.hidden_size, bias=a.attention_bias)
        self.mla = MLAAttention(self.num_heads, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim,
                                a.v_head_dim, softmax_scale(qk_head_dim, a.rope), backend)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.num_heads, -1).split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = apply_rope(q_pe, cos, sin, self.rope_interleave)
        k_pe = apply_rope(k_pe, cos, sin, self.rope_interleave)
        return self.o_proj(self.mla(q_nope, q_pe, c_kv, k_pe, self.kv_b_proj.weight))


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, a: DeepseekV3Args, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = DeepseekV3Attention(a, backend)
        if a.is_moe_layer(layer_idx):
            self.mlp: nn.Module = DeepseekMoE(a.hidden_size, a.moe_intermediate_size, a.n_shared_experts,
                                              a.router)
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
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(a, i, backend) for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        # One table for all layers (V3: 163840 positions), like HF's model-level rotary_emb.
        self.rotary_emb = DeepseekRotaryEmbedding(a.qk_rope_head_dim, a.max_position_embeddings, a.rope,
                                                  a.rope_interleave)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin)
        x, _ = self.norm(x, residual)
        return x


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, cfg: dict[str, Any], *, attention_backend: AttentionBackend = AttentionBackend.SDPA) -> None:
        super().__init__()
        self.config = cfg
        self.args = DeepseekV3Args.from_hf(cfg)
        self.model = DeepseekV3Model(self.args, attention_backend)
        self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

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
        for a in self.attention_layers():
            a.bind_cache(num_blocks[a.kv_group], block_size, dtype, device)

    def free_kv_cache(self) -> None:
        for a in self.attention_layers():
            a.free_cache()

    # -- weights ---------------------------------------------------------------------------------
    def checkpoint_tensor_names(self) -> set[str]:
        """Every tensor name an HF checkpoint of this config must contain (per-expert, unfused names)."""
        names: set[str] = set()
        for pname, p in self.named_parameters():
            if pname.endswith(".experts.w13_weight") or pname.endswith(".experts.w2_weight"):
                prefix, kind = pname.rsplit(".", 1)
                projs = ("gate_proj", "up_proj") if kind == "w13_weight" else ("down_proj",)
                names.update(f"{prefix}.{e}.{proj}.weight" for e in range(p.shape[0]) for proj in projs)
            elif ".gate_up_proj." in pname:
                names.update(pname.replace(".gate_up_proj.", f".{p}.") for p in ("gate_proj", "up_proj"))
            else:
                names.add(pname)
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        dtype = self.model.embed_tokens.weight.dtype
        loaded: set[str] = set()
        fp8_weights: dict[str, torch.Tensor] = {}  # a weight and its scale may sit in different shards
        scales: dict[str, torch.Tensor] = {}
        mtp = 0
        for name, tensor in weights:
            m = _LAYER.match(name)
            if m and int(m.group(1)) >= self.args.num_hidden_layers:
                mtp += 1
                continue
            if "rotary_emb.inv_freq" in name or (self.args.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if name.endswith(".weight_scale_inv"):
                key = name[:-len("_scale_inv")]
                scales[key] = tensor
            elif tensor.dtype == FP8_DTYPE:
                if self.args.fp8_block is None:
                    raise WeightLoadError(f"tensor {name!r} is float8 but config.json has no fp8 "
                                          "quantization_config")
                key = name
                fp8_weights[key] = tensor
            else:
                self._load_one(params, name, tensor)
                loaded.add(name)
                continue
            if key in fp8_weights and key in scales:
                try:
                    w = dequantize_fp8_block(fp8_weights.pop(key), scales.pop(key), self.args.fp8_block,
                                             dtype)
                except ValueError as e:
                    raise WeightLoadError(f"tensor {key!r}: {e}") from None
                self._load_one(params, key, w)
                loaded.add(key)
        if fp8_weights or scales:
            raise WeightLoadError(f"FP8 weights without weight_scale_inv: {sorted(fp8_weights)[:5]}; scales "
                                  f"without weights: {sorted(s + '_scale_inv' for s in scales)[:5]}")
        if mtp:
            logger.info("ignoring %d MTP tensors (model.layers.%d.*): MTP speculative decoding is not "
                        "supported", mtp, self.args.num_hidden_layers)
        missing = self.checkpoint_tensor_names() - loaded
        if missing:
            raise WeightLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
        return loaded

    def _load_one(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
        m = _EXPERT.match(name)
        if m:
            experts = self._submodule(m.group(1), name)
            e, proj = int(m.group(2)), m.group(3)
            if not isinstance(experts, DeepseekExperts) or e >= experts.w13_weight.shape[0]:
                raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model")
            i = experts.intermediate_size
            dst = {"gate_proj": experts.w13_weight[e, :i], "up_proj": experts.w13_weight[e, i:],
                   "down_proj": experts.w2_weight[e]}[proj]
            copy_into(dst, tensor, name)
            return
        for proj, shard in ((".gate_proj.", 0), (".up_proj.", 1)):
            if proj in name:  # dense MLP / shared experts: HF's gate and up fill halves of gate_up_proj
                fused = params.get(name.replace(proj, ".gate_up_proj."))
                if fused is None:
                    raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model")
                half = fused.shape[0] // 2
                copy_into(fused[shard * half:(shard + 1) * half], tensor, name)
                return
        if name not in params:
            raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model")
        copy_into(params[name], tensor, name)

    def _submodule(self, path: str, name: str) -> nn.Module:
        try:
            return self.get_submodule(path)
        except AttributeError:
            raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model") from None
