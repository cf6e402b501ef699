"""The config.json fields DeepSeek-V3 uses, validated once at construction (errors name the field)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openinfer.layers.deepseek_moe import RouterConfig
from openinfer.layers.fp8 import fp8_block_size
from openinfer.layers.rotary import rope_parameters


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
