#!/usr/bin/env python
"""Write random DeepSeek-shaped HF checkpoints (config.json, safetensors shards, char tokenizer) of any size.

    python scripts/make_deepseek_checkpoint.py --arch v3 --size tiny --out /tmp/dsv3-tiny
    python scripts/make_deepseek_checkpoint.py --arch v3 --size full --fp8 --dtype bfloat16 --out /data/v3
    python scripts/make_deepseek_checkpoint.py --arch v3 --size small --set num_hidden_layers=4 --out ...

Tensors are generated one at a time and flushed into shards of ``--shard-gb``, so any size fits in memory.
Names and config follow what transformers' ``save_pretrained`` writes for V3 (spec §12); ``--fp8`` writes
DeepSeek's release format instead: float8_e4m3fn linear weights + fp32 ``weight_scale_inv`` per 128x128 block
and ``quantization_config``. The same seed gives the same underlying weights with and without ``--fp8``.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from openinfer.layers.fp8 import DEFAULT_BLOCK, quantize_fp8_block  # noqa: E402

_V3_COMMON: dict[str, Any] = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_act="silu",
    attention_bias=False, attention_dropout=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=None,
    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True, norm_topk_prob=True,
    n_shared_experts=1, num_nextn_predict_layers=0, initializer_range=0.02, use_cache=True,
    routed_scaling_factor=2.5,
)
_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_TEST_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                 max_position_embeddings=512, rope_parameters=_DEFAULT_ROPE)


def _yarn(factor: float) -> dict[str, Any]:
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor,
            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
            "mscale_all_dim": 1.0}


V3_SIZES: dict[str, dict[str, Any]] = {
    # Unit-test size: every code path, runs in milliseconds on one CPU core.
    "tiny": dict(_TEST_MOE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, q_lora_rank=32,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    # hidden 256: FP8 128x128 blocks are real (several per matrix, ragged edges).
    "small": dict(_TEST_MOE, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                  q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
    # ~3B params with V3's head shapes: a single-GPU functional/perf stand-in.
    "medium": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, moe_intermediate_size=1024,
                   num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                   first_k_dense_replace=1, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_group=8,
                   topk_group=4, max_position_embeddings=16384, rope_parameters=_yarn(4.0)),
    # DeepSeek-V3 / R1 (671B) shapes, spec §6.
    "full": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                 num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                 first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                 topk_group=4, max_position_embeddings=163840, rope_parameters=_yarn(40.0)),
}


def v3_config(size: str = "tiny", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    if size not in V3_SIZES:
        raise ValueError(f"size={size!r}; choose one of {', '.join(V3_SIZES)}")
    return {**_V3_COMMON, **V3_SIZES[size], **(overrides or {})}


def v3_tensor_shapes(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """HF tensor names and shapes, in layer order (so shards hold whole layers where they can); then the MTP
    layers (``num_nextn_predict_layers``) under ``model.layers.{num_hidden_layers + i}``, as DeepSeek releases
    them: a full decoder block plus enorm / hnorm / eh_proj and their own embedding and shared head."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    yield "model.embed_tokens.weight", (vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        yield from _v3_layer_shapes(cfg, i)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (vocab, h)
    for i in range(cfg["num_hidden_layers"], cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{i}"
        yield f"{p}.embed_tokens.weight", (vocab, h)
        yield f"{p}.enorm.weight", (h,)
        yield f"{p}.hnorm.weight", (h,)
        yield f"{p}.eh_proj.weight", (h, 2 * h)
        yield from _v3_layer_shapes(cfg, i)
        yield f"{p}.shared_head.norm.weight", (h,)
        yield f"{p}.shared_head.head.weight", (vocab, h)


def _v3_layer_shapes(cfg: dict[str, Any], i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    lora_kv, lora_q = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
    p = f"model.layers.{i}"
    yield f"{p}.input_layernorm.weight", (h,)
    yield f"{p}.post_attention_layernorm.weight", (h,)
    if lora_q is None:
        yield f"{p}.self_attn.q_proj.weight", (heads * (nope + rope), h)
    else:
        yield f"{p}.self_attn.q_a_proj.weight", (lora_q, h)
        yield f"{p}.self_attn.q_a_layernorm.weight", (lora_q,)
        yield f"{p}.self_attn.q_b_proj.weight", (heads * (nope + rope), lora_q)
    yield f"{p}.self_attn.kv_a_proj_with_mqa.weight", (lora_kv + rope, h)
    yield f"{p}.self_attn.kv_a_layernorm.weight", (lora_kv,)
    yield f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + v), lora_kv)
    yield f"{p}.self_attn.o_proj.weight", (h, heads * v)
    if i < cfg["first_k_dense_replace"]:
        mlps = [(f"{p}.mlp", cfg["intermediate_size"])]
    else:
        e, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        yield f"{p}.mlp.gate.weight", (e, h)
        yield f"{p}.mlp.gate.e_score_correction_bias", (e,)
        mlps = [(f"{p}.mlp.experts.{j}", inter) for j in range(e)]
        if cfg.get("n_shared_experts"):
            mlps.append((f"{p}.mlp.shared_experts", inter * cfg["n_shared_experts"]))
    for mp, inter in mlps:
        yield f"{mp}.gate_proj.weight", (inter, h)
        yield f"{mp}.up_proj.weight", (inter, h)
        yield f"{mp}.down_proj.weight", (h, inter)


def _is_fp8_target(name: str, shape: tuple[int, ...]) -> bool:
    # DeepSeek's release quantises every linear inside the blocks except the router; embeddings, lm_head and
    # norms stay in bf16.
    # The MTP layers' own embedding, eh_proj and shared head stay unquantised too.
    return len(shape) == 2 and ".layers." in name and not name.endswith(
        ("mlp.gate.weight", "embed_tokens.weight", "eh_proj.weight", "shared_head.head.weight"))


def _random(name: str, shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("e_score_correction_bias"):
        return 0.05 * torch.randn(shape, generator=gen)
    return std * torch.randn(shape, generator=gen)


class _ShardWriter:
    def __init__(self, path: Path, shard_bytes: int) -> None:
        self.path, self.shard_bytes = path, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.shard_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes

    def flush(self) -> None:
        if self.pending:
            tmp = f"shard-{len(self.files):05d}.tmp"
            save_file(self.pending, str(self.path / tmp), metadata={"format": "pt"})
            self.files.append((tmp, list(self.pending)))
            self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self.flush()
        n = len(self.files)
        if n == 1:
            (self.path / self.files[0][0]).rename(self.path / "model.safetensors")
            return
        weight_map = {}
        for i, (tmp, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.path / tmp).rename(self.path / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    # A char tokenizer: offline, deterministic, padded to any vocab size.
    from openinfer.utils.char_tokenizer import write_char_tokenizer

    write_char_tokenizer(path, vocab_size)


def make_v3(path: str | Path, size: str = "tiny", *, fp8: bool = False, seed: int = 0, init_std: float = 0.08,
            dtype: torch.dtype = torch.float32, overrides: dict[str, Any] | None = None,
            shard_gb: float = 4.0) -> Path:
    """Write a random DeepSeek-V3 checkpoint with tokenizer; returns the path. ``init_std`` is larger than a
    trained model's so tiny models have well-separated logits (greedy ties are unlikely)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = v3_config(size, overrides)
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(DEFAULT_BLOCK)}
    gen = torch.Generator().manual_seed(seed)
    writer = _ShardWriter(path, int(shard_gb * (1 << 30)))
    for name, shape in v3_tensor_shapes(cfg):
        t = _random(name, shape, init_std, gen)
        if fp8 and _is_fp8_target(name, shape):
            q, scale_inv = quantize_fp8_block(t)
            writer.add(name, q)
            writer.add(name + "_scale_inv", scale_inv)
        elif name.endswith("e_score_correction_bias"):
            writer.add(name, t.float())  # HF keeps it fp32 (_keep_in_fp32_modules_strict)
        else:
            writer.add(name, t.to(dtype))
    writer.close()
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    _write_tokenizer(path, cfg["vocab_size"])
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=["v3"], required=True)
    ap.add_argument("--size", default="tiny", help=f"v3: {', '.join(V3_SIZES)}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--fp8", action="store_true", help="FP8 e4m3 block-128 weights with weight_scale_inv")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-std", type=float, default=0.08)
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override a config field, e.g. --set num_hidden_layers=4 --set q_lora_rank=null")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    out = make_v3(args.out, args.size, fp8=args.fp8, seed=args.seed, init_std=args.init_std,
                  dtype=getattr(torch, args.dtype), overrides=overrides, shard_gb=args.shard_gb)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
