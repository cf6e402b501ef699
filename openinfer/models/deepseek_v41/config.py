"""DeepSeek-V4.1 configuration, parsed from config.json (nested ``text_config``) as DeepInfer 0.1.0 reads it
(``deepinfer/hugging_face/config.py``) into one frozen dataclass, validated once.

What differs from V4 (spec §7): compress ratios are 0 (sliding window only), 1 (C1) or 2 (C2); cross-layer
sharing lists (``kv_source_layer_ids``, ``index_source_layer_ids``, optional ``index_k_source_layer_ids``);
candidate blocks; Engram tables; no hash-routed MoE layers; the ``num_nextn_predict_layers`` trailing entries of
``compress_ratios`` belong to the DSpark draft blocks. Every malformed field raises ValueError naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openinfer.layers.deepseek_moe import RouterConfig
from openinfer.models.deepseek_v4.config import RopeConfig, _rope_configs
from openinfer.models.deepseek_v41.topology import SharedTopology

COMPRESS_RATIOS = (0, 1, 2)
# DeepInfer rejects every other quantisation layout (hugging_face/config.py).
QUANTIZATION = {"quant_method": "fp8", "expert_dtype": "fp4", "activation_scheme": "dynamic",
                "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}


@dataclass(frozen=True)
class EngramConfig:
    layer_ids: tuple[int, ...]
    max_ngram_size: int  # n-grams of 2..max_ngram_size tokens: max_ngram_size - 1 tables
    n_heads: int  # hash heads per n-gram order
    head_dim: int  # table width
    vocab_size: int  # per n-gram order; each head's table size is a distinct prime >= it
    pad_token_id: int  # stands in for the tokens before the sequence start
    tokenizer_vocab_size: int  # bounds the hash multipliers (the compressed vocabulary's size when compressing)
    # Tokenizer compression (``engram_compressed_vocab_size``): ids are first mapped to a normalised vocabulary
    # built from the checkpoint's tokenizer.json (engram.py).
    tokenizer_file: str | None = None

    @property
    def embed_dim(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads * self.head_dim


@dataclass(frozen=True)
class DSparkConfig:
    block_size: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    noise_token_id: int


@dataclass(frozen=True)
class VisionConfig:
    """The fields of ``vision_config`` DeepInfer reads to build the model (hugging_face/config.py ``_build_vision``:
    the projector's input width and downsample; the ViT's shape is fixed in its vision_encoder/vit.py). The tower
    itself is vision.py (VisionTowerConfig), the image geometry multimodal/image_layout.py."""
    hidden_size: int
    downsample_ratio: int


@dataclass(frozen=True)
class DeepseekV41Config:
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
    compress_ratios: tuple[int, ...]  # main layers then the DSpark layers
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    topology: SharedTopology
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float | None
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig
    max_position_embeddings: int
    num_nextn_predict_layers: int
    engram: EngramConfig | None
    dspark: DSparkConfig | None
    tie_word_embeddings: bool = False
    fp8_block: tuple[int, int] | None = None
    expert_dtype: str | None = None
    vision: VisionConfig | None = None
    # DeepInfer's compressed-KV format switch (hugging_face/config.py, default true: FP4, else MXFP8); applied by
    # kv_cache_dtype fp8 (cache.KVNumerics).
    use_fp4_sparse_kv: bool = True

    @property
    def router(self) -> RouterConfig:
        return RouterConfig(n_routed_experts=self.n_routed_experts, num_experts_per_tok=self.num_experts_per_tok,
                            scoring_func=self.scoring_func, norm_topk_prob=self.norm_topk_prob,
                            routed_scaling_factor=self.routed_scaling_factor)

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> DeepseekV41Config:
        """``cfg``: config.json with ``text_config`` folded into the top level (openinfer.config does that), or
        the raw file."""
        if isinstance(cfg.get("text_config"), dict):
            cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **cfg["text_config"]}
        vision = _vision(cfg.get("vision_config"))

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise ValueError(f"DeepSeek-V4.1 config.json is missing {key!r}")
            return cfg[key]

        for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("num_key_value_heads", 1)):
            if key in cfg and cfg[key] != expected:
                raise ValueError(f"{key}={cfg[key]!r} is not supported; DeepSeek-V4.1 expects {expected!r}")
        fp8_block, expert_dtype = _quantization(cfg.get("quantization_config"))
        n = int(need("num_hidden_layers"))
        nextn = int(cfg.get("num_nextn_predict_layers") or 0)
        ratios = tuple(int(r) for r in need("compress_ratios"))
        if len(ratios) != n + nextn:
            raise ValueError(f"compress_ratios has {len(ratios)} entries, expected num_hidden_layers + "
                             f"num_nextn_predict_layers = {n} + {nextn} = {n + nextn}")
        # DeepInfer builds every DSpark block as a sliding-window layer whatever its compress_ratios entry says
        # (hugging_face/config.py _dflash_spec): those entries are read as 0.
        ratios = ratios[:n] + (0,) * nextn
        bad = sorted({r for r in ratios if r not in COMPRESS_RATIOS})
        if bad:
            raise ValueError(f"compress_ratios holds {bad}: DeepSeek-V4.1 compresses with ratio 1 (C1) or 2 (C2) "
                             "only, 0 = sliding window only")
        index_topk = int(need("index_topk"))
        if index_topk <= 0:
            raise ValueError(f"index_topk must be > 0, got {index_topk}")
        candidate = cfg.get("candidate_source_layer_id")
        topology = SharedTopology.build(
            ratios, n, list(need("kv_source_layer_ids")), list(need("index_source_layer_ids")),
            cfg.get("index_k_source_layer_ids"), None if candidate is None else int(candidate),
            int(cfg.get("candidate_topk_blocks") or 0), int(cfg.get("candidate_block_size") or 0), index_topk)
        head_dim = int(need("head_dim"))
        rope_dim = int(need("qk_rope_head_dim"))
        if rope_dim % 2 or not 0 < rope_dim <= min(head_dim, int(need("index_head_dim"))):
            raise ValueError(f"qk_rope_head_dim={rope_dim} must be even and <= head_dim and index_head_dim")
        heads, o_groups = int(need("num_attention_heads")), int(need("o_groups"))
        if heads % o_groups:
            raise ValueError(f"o_groups={o_groups} must divide num_attention_heads={heads}")
        if cfg.get("hc_shifted", True) is not True:
            raise ValueError(f"hc_shifted={cfg['hc_shifted']!r} is not supported: only the shifted mHC (DeepInfer's "
                             "default, what DeepSeek-V4.1 ships; no hc_head tensors) is implemented")
        main_rope, compress_rope = _rope_configs(_yarn_typed(cfg), rope_dim)
        limit = cfg.get("swiglu_limit")
        if int(cfg.get("num_hash_layers") or 0):
            raise ValueError("num_hash_layers: DeepSeek-V4.1 has no hash-routed MoE layers")
        vocab = int(need("vocab_size"))
        hc_mult = int(need("hc_mult"))
        if hc_mult <= 1:
            raise ValueError(f"hc_mult={hc_mult} must be > 1 (mHC streams)")
        return cls(
            vocab_size=vocab, hidden_size=int(need("hidden_size")), num_hidden_layers=n,
            num_attention_heads=heads, head_dim=head_dim, qk_rope_head_dim=rope_dim,
            q_lora_rank=int(need("q_lora_rank")), o_groups=o_groups, o_lora_rank=int(need("o_lora_rank")),
            sliding_window=_positive(cfg, "sliding_window"), compress_ratios=ratios,
            index_n_heads=_positive(cfg, "index_n_heads"), index_head_dim=_positive(cfg, "index_head_dim"),
            index_topk=index_topk, topology=topology,
            n_routed_experts=int(need("n_routed_experts")), n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            scoring_func=str(cfg.get("scoring_func", "sqrtsoftplus")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            swiglu_limit=None if limit is None else float(limit),
            hc_mult=hc_mult, hc_sinkhorn_iters=_positive(cfg, "hc_sinkhorn_iters"),
            hc_eps=float(cfg.get("hc_eps", 1e-6)), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            main_rope=main_rope, compress_rope=compress_rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            num_nextn_predict_layers=nextn, engram=_engram(cfg, n, vocab),
            dspark=_dspark(cfg, n) if nextn else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            fp8_block=fp8_block, expert_dtype=expert_dtype, vision=vision,
            use_fp4_sparse_kv=_flag(cfg, "use_fp4_sparse_kv", True),
        )


def _flag(cfg: dict[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r} must be true or false")
    return value


def _vision(vc: Any) -> VisionConfig | None:
    if vc is None:
        return None
    if not isinstance(vc, dict):
        raise ValueError(f"vision_config must be an object, got {type(vc).__name__}")
    return VisionConfig(hidden_size=_positive(vc, "hidden_size", "vision_config."),
                        downsample_ratio=_positive(vc, "downsample_ratio", "vision_config."))


def _yarn_typed(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepInfer applies YaRN to the compressed layers whenever ``rope_scaling`` is set, with or without a
    ``type`` key (hugging_face/config.py _compress_spec); V4's reader takes a type-less one for plain RoPE."""
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and scaling and "type" not in scaling and "rope_type" not in scaling:
        return {**cfg, "rope_scaling": {**scaling, "type": "yarn"}}
    return cfg


def _positive(cfg: dict[str, Any], key: str, where: str = "") -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or v <= 0:
        raise ValueError(f"{where}{key} must be a positive int, got {v!r}")
    return v


def _quantization(qc: dict[str, Any] | None) -> tuple[tuple[int, int] | None, str | None]:
    """None = an unquantised checkpoint (openinfer's own test/bench format); else exactly DeepInfer's layout."""
    if not qc:
        return None, None
    for key, expected in QUANTIZATION.items():
        if qc.get(key) != expected:
            raise ValueError(f"quantization_config.{key}={qc.get(key)!r} is not supported; DeepSeek-V4.1 ships "
                             f"{expected!r}")
    return (32, 32), "fp4"


def _engram(cfg: dict[str, Any], n: int, vocab: int) -> EngramConfig | None:
    layer_ids = cfg.get("engram_layer_ids")
    if not layer_ids:
        return None
    bad = [i for i in layer_ids if not isinstance(i, int) or not 0 <= i < n]
    if bad:
        raise ValueError(f"engram_layer_ids holds unknown layer ids {bad}: layers are 0..{n - 1}")
    compressed = cfg.get("engram_compressed_vocab_size")
    tokenizer_file = None
    if compressed:
        if not isinstance(compressed, int) or compressed <= 0:
            raise ValueError(f"engram_compressed_vocab_size={compressed!r} must be a positive int")
        if not cfg.get("_checkpoint_dir"):
            raise ValueError("engram_compressed_vocab_size: Engram tokenizer compression needs the checkpoint's "
                             "tokenizer.json (load the model from its directory)")
        tokenizer_file = str(Path(cfg["_checkpoint_dir"]) / "tokenizer.json")
    size = _positive(cfg, "engram_max_ngram_size")
    if size < 2:
        raise ValueError(f"engram_max_ngram_size={size} must be >= 2 (n-grams of 2.. tokens)")
    pad = cfg.get("engram_pad_token_id")
    if not isinstance(pad, int) or not 0 <= pad < vocab:
        raise ValueError(f"engram_pad_token_id={pad!r} must be a token id in [0, vocab_size={vocab})")
    return EngramConfig(tuple(layer_ids), size, _positive(cfg, "engram_n_heads"), _positive(cfg, "engram_head_dim"),
                        _positive(cfg, "engram_vocab_size"), pad, compressed or vocab, tokenizer_file)


def _dspark(cfg: dict[str, Any], n: int) -> DSparkConfig:
    targets = cfg.get("dspark_target_layer_ids")
    if not targets or any(not isinstance(i, int) or not 0 <= i < n for i in targets):
        raise ValueError(f"dspark_target_layer_ids={targets!r} must list main-model layers 0..{n - 1}")
    return DSparkConfig(_positive(cfg, "dspark_block_size"), tuple(targets), _positive(cfg, "dspark_markov_rank"),
                        _positive(cfg, "dspark_n_routed_experts"), _positive(cfg, "dspark_num_experts_per_tok"),
                        int(cfg.get("dspark_noise_token_id") or 0))
