"""DeepSeek-V4 configuration: both config.json styles folded into one frozen dataclass, validated once.

Two styles exist in the wild (spec §2, §12):
- DeepSeek's release: ``compress_ratios`` (per layer incl. MTP; 0 = SWA only, 4 = CSA, other = HCA),
  ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling`` (YaRN, applied to compressed layers only).
- transformers': ``layer_types`` + ``compress_rates``, ``mlp_layer_types``, ``partial_rotary_factor``,
  ``rope_parameters = {"main": {...}, "compress": {...}}``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openinfer.layers.deepseek_moe import RouterConfig
from openinfer.layers.fp8 import fp8_block_size

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ATTN_TYPES = (SLIDING, CSA, HCA)
EXPERT_DTYPES = ("bf16", "fp8", "fp4")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_dim: int
    # YaRN (compressed layers only); factor None = plain RoPE.
    factor: float | None = None
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # V4 does not scale cos/sin by YaRN's mscale (HF pins attention_factor=1.0).
    attention_factor: float = 1.0

    def params(self) -> dict:
        """In the HF ``rope_parameters`` form ``layers/rotary.py`` reads."""
        if self.factor is None:
            return {"rope_type": "default", "rope_theta": self.theta}
        return {"rope_type": "yarn", "rope_theta": self.theta, "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position, "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow, "attention_factor": self.attention_factor}


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    # Per layer (main layers first, then the MTP layers): attention type and compress ratio (0 for SWA).
    layer_types: tuple[str, ...]
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_hash_layers: int
    swiglu_limit: float | None
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig
    max_position_embeddings: int
    num_nextn_predict_layers: int
    tie_word_embeddings: bool = False
    # FP8 block size of the quantised linears (None: unquantised) and the routed experts' storage format
    # (spec §2: V4-Flash "fp4" = MXFP4, V4-Flash-Base "fp8"); both are dequantised at load.
    fp8_block: tuple[int, int] | None = None
    expert_dtype: str | None = None

    def __post_init__(self) -> None:
        n = self.num_hidden_layers + self.num_nextn_predict_layers
        if len(self.compress_ratios) != n or len(self.layer_types) != n:
            raise ValueError(f"compress_ratios has {len(self.compress_ratios)} entries, expected "
                             f"num_hidden_layers + num_nextn_predict_layers = {n}")
        if self.index_topk <= 0:
            raise ValueError(f"index_topk must be > 0, got {self.index_topk}")
        _ = self.router  # validates scoring_func, num_experts_per_tok and routed_scaling_factor
        if self.expert_dtype not in (None, *EXPERT_DTYPES):
            raise ValueError(f"expert_dtype={self.expert_dtype!r} is not supported (supported: "
                             f"{', '.join(EXPERT_DTYPES)})")
        if self.hc_mult <= 0 or self.hc_sinkhorn_iters <= 0:
            raise ValueError(f"hc_mult and hc_sinkhorn_iters must be > 0, got {self.hc_mult}, "
                             f"{self.hc_sinkhorn_iters}")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.head_dim:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= head_dim")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"o_groups={self.o_groups} must divide num_attention_heads * head_dim")
        for i, (kind, ratio) in enumerate(zip(self.layer_types, self.compress_ratios)):
            if kind not in ATTN_TYPES or (ratio == 0) != (kind == SLIDING) or ratio < 0:
                raise ValueError(f"layer {i}: layer type {kind!r} with compress ratio {ratio} is invalid")
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0, got {self.sliding_window}")

    @property
    def router(self) -> RouterConfig:
        """The shared router's settings (layers/deepseek_moe.py); V4 has no group-limited routing."""
        return RouterConfig(n_routed_experts=self.n_routed_experts,
                            num_experts_per_tok=self.num_experts_per_tok, scoring_func=self.scoring_func,
                            norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor)

    def is_hash_layer(self, layer_idx: int) -> bool:
        return layer_idx < self.num_hash_layers  # MTP layers sit past num_hidden_layers, never hash-routed

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> DeepseekV4Config:
        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise ValueError(f"DeepSeek-V4 config.json is missing {key!r}")
            return cfg[key]

        num_layers = int(need("num_hidden_layers"))
        nextn = int(cfg.get("num_nextn_predict_layers") or 0)
        head_dim = int(need("head_dim"))
        layer_types, ratios = _attention_schedule(cfg, num_layers, nextn)
        if cfg.get("qk_rope_head_dim") is not None:
            rope_dim = int(cfg["qk_rope_head_dim"])
        elif cfg.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * float(cfg["partial_rotary_factor"]))
        else:
            raise ValueError("DeepSeek-V4 config.json has neither 'qk_rope_head_dim' nor 'partial_rotary_factor'")
        main_rope, compress_rope = _rope_configs(cfg, rope_dim)
        if cfg.get("mlp_layer_types") is not None:
            mlp = list(cfg["mlp_layer_types"])
            if len(mlp) != num_layers or any(t not in ("hash_moe", "moe") for t in mlp):
                raise ValueError(f"mlp_layer_types must list {num_layers} entries of 'hash_moe'/'moe', got {mlp}")
            num_hash = mlp.count("hash_moe")
            if mlp != ["hash_moe"] * num_hash + ["moe"] * (num_layers - num_hash):
                raise ValueError(f"mlp_layer_types must put every 'hash_moe' layer first, got {mlp}")
        else:
            num_hash = int(cfg.get("num_hash_layers", 0))
        limit = cfg.get("swiglu_limit")
        # V4-Flash puts expert_dtype at the top level, V4.1 inside quantization_config (spec §2, §7).
        expert_dtype = cfg.get("expert_dtype") or (cfg.get("quantization_config") or {}).get("expert_dtype")
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=int(need("num_attention_heads")),
            head_dim=head_dim,
            qk_rope_head_dim=rope_dim,
            q_lora_rank=int(need("q_lora_rank")),
            o_groups=int(need("o_groups")),
            o_lora_rank=int(need("o_lora_rank")),
            sliding_window=int(need("sliding_window")),
            layer_types=tuple(layer_types),
            compress_ratios=tuple(ratios),
            index_n_heads=int(need("index_n_heads")),
            index_head_dim=int(need("index_head_dim")),
            index_topk=int(need("index_topk")),
            n_routed_experts=int(cfg.get("n_routed_experts") or need("num_local_experts")),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            scoring_func=str(cfg.get("scoring_func", "sqrtsoftplus")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            num_hash_layers=num_hash,
            swiglu_limit=None if limit is None else float(limit),
            hc_mult=int(need("hc_mult")),
            hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(cfg.get("hc_eps", 1e-6)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            main_rope=main_rope,
            compress_rope=compress_rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            num_nextn_predict_layers=nextn,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            fp8_block=fp8_block_size(cfg),
            expert_dtype=expert_dtype,
        )


def _attention_schedule(cfg: dict[str, Any], num_layers: int, nextn: int) -> tuple[list[str], list[int]]:
    if cfg.get("layer_types") is not None:
        types = list(cfg["layer_types"])
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries, expected num_hidden_layers={num_layers}")
        bad = [t for t in types if t not in ATTN_TYPES]
        if bad:
            raise ValueError(f"layer_types entries must be one of {ATTN_TYPES}, got {bad}")
        rates = {CSA: 4, HCA: 128, **(cfg.get("compress_rates") or {})}
        for kind in (CSA, HCA):
            if kind in types and (not isinstance(rates.get(kind), int) or rates[kind] <= 0):
                raise ValueError(f"compress_rates[{kind!r}] must be a positive int, got {rates.get(kind)!r}")
        # The MTP layers are sliding-window only in every released V4 checkpoint; HF's config has no slot for them.
        types = types + [SLIDING] * nextn
        return types, [0 if t == SLIDING else rates[t] for t in types]
    if cfg.get("compress_ratios") is None:
        raise ValueError("DeepSeek-V4 config.json has neither 'layer_types' nor 'compress_ratios'")
    ratios = [int(r) for r in cfg["compress_ratios"]]
    if len(ratios) != num_layers + nextn:
        raise ValueError(f"compress_ratios has {len(ratios)} entries, expected num_hidden_layers + "
                         f"num_nextn_predict_layers = {num_layers + nextn}")
    if any(r < 0 for r in ratios):
        raise ValueError(f"compress_ratios entries must be >= 0, got {ratios}")
    # DeepSeek's reference: ratio 4 is the overlapped compressor with an indexer (CSA); any other ratio is HCA.
    return [SLIDING if r == 0 else CSA if r == 4 else HCA for r in ratios], ratios


def _rope_configs(cfg: dict[str, Any], rope_dim: int) -> tuple[RopeConfig, RopeConfig]:
    rp = cfg.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], rp["compress"]
    else:  # DeepSeek style / legacy HF: YaRN in rope_scaling (or a flat rope_parameters) for compressed layers
        scaling = {k: v for k, v in {**(cfg.get("rope_scaling") or {}), **rp}.items()
                   if k not in ("main", "compress", "rope_theta")}
        main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
        comp = {**scaling, "rope_theta": cfg.get("compress_rope_theta", 160000.0)}
    main_kind = main.get("rope_type", main.get("type", "default"))
    if main_kind != "default":
        raise ValueError(f"rope_parameters['main'] must be plain RoPE, got rope_type={main_kind!r}")
    main_rope = RopeConfig(theta=float(main.get("rope_theta", 10000.0)), rope_dim=rope_dim)
    kind = comp.get("rope_type", comp.get("type", "default"))
    if kind == "default":
        return main_rope, RopeConfig(theta=float(comp.get("rope_theta", 160000.0)), rope_dim=rope_dim)
    if kind != "yarn":
        raise ValueError(f"rope_scaling type {kind!r} is not supported for DeepSeek-V4 (only yarn)")
    for key in ("factor", "original_max_position_embeddings"):
        if comp.get(key) is None:
            raise ValueError(f"rope_scaling (yarn) is missing {key!r}")
    return main_rope, RopeConfig(
        theta=float(comp.get("rope_theta", 160000.0)), rope_dim=rope_dim, factor=float(comp["factor"]),
        original_max_position=int(comp["original_max_position_embeddings"]),
        beta_fast=float(comp.get("beta_fast") or 32), beta_slow=float(comp.get("beta_slow") or 1),
        attention_factor=float(comp.get("attention_factor") or 1.0),
    )
