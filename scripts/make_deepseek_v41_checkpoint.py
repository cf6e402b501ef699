"""Write a random DeepSeek-V4.1-shaped checkpoint in DeepInfer 0.1.0's exact format: config.json with a nested
``text_config`` and its ``quantization_config`` (FP8 e4m3 linears with UE8M0 ``.scale`` per 32x32 block, MXFP4
routed experts, FP8 Engram tables with a UE8M0 scale per 32 values of a row), tensors under DeepInfer's HF names
(``deepinfer/hugging_face/names.py``: ``embed.weight``, ``layers.N.attn.wq_a.weight``, ``layers.N.attn.indexer.wk``,
``layers.N.engram.embed.weight``, ``mtp.K...``), and a char tokenizer.

  python scripts/make_deepseek_v41_checkpoint.py --size tiny  --out /tmp/v41-tiny    # tests
  python scripts/make_deepseek_v41_checkpoint.py --size bench --out /tmp/v41-bench   # benchmarks

The tensors are enumerated from the config here, independently of openinfer's model, so loading one checks the
loader against DeepInfer's naming (which layers own a compressor, an indexer, a key projection, an Engram).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from openinfer.layers.fp8 import quantize_fp8_block  # noqa: E402
from openinfer.layers.mxfp4 import quantize_mxfp4  # noqa: E402
from openinfer.utils.char_tokenizer import write_char_tokenizer  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {
    # 8 layers: SWA, SWA + Engram (tokenizer compression: the char tokenizer's 256 ids -> 228), C2 x3 (KV source 2, index sources 2 and 4, Engram on 3), C1 x3 (YOCO from
    # layer 5: KV sources 5 and 7 - 7 compressed from the shared hidden -, index sources 5 and 7, candidate
    # blocks chosen at 5 and used at 7, layer 6 reusing 5's top-k); one DSpark block.
    "tiny": dict(
        vocab_size=256, hidden_size=128, num_hidden_layers=8, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, moe_intermediate_size=64,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, sliding_window=8,
        compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0], kv_source_layer_ids=[2, 5, 7],
        index_source_layer_ids=[2, 4, 5, 7], candidate_source_layer_id=5, candidate_topk_blocks=8,
        candidate_block_size=2, index_n_heads=8, index_head_dim=32, index_topk=4, engram_layer_ids=[1, 3],
        engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=32, engram_vocab_size=97,
        engram_pad_token_id=2, engram_compressed_vocab_size=228, num_nextn_predict_layers=1, dspark_block_size=4, dspark_target_layer_ids=[5, 6, 7],
        dspark_markov_rank=16, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2, dspark_noise_token_id=3,
        max_position_embeddings=1024,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32,
                      "beta_slow": 1},
    ),
    # V4.1-Flash's pattern (2 SWA layers, C2 then C1 from the YOCO boundary, window 128) at small width.
    "bench": dict(
        vocab_size=8192, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, head_dim=128,
        qk_rope_head_dim=32, q_lora_rank=384, o_groups=4, o_lora_rank=256, moe_intermediate_size=384,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=6, sliding_window=128,
        compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0], kv_source_layer_ids=[2, 5],
        index_source_layer_ids=[2, 4, 5, 7], candidate_source_layer_id=5, candidate_topk_blocks=64,
        candidate_block_size=8, index_n_heads=16, index_head_dim=64, index_topk=64, engram_layer_ids=[1],
        engram_max_ngram_size=4, engram_n_heads=4, engram_head_dim=64, engram_vocab_size=50000,
        engram_pad_token_id=2, num_nextn_predict_layers=1, dspark_block_size=4, dspark_target_layer_ids=[5, 6, 7],
        dspark_markov_rank=64, dspark_n_routed_experts=8, dspark_num_experts_per_tok=2, dspark_noise_token_id=3,
        max_position_embeddings=16384,
        rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                      "beta_slow": 1},
    ),
    # For decode curves out to 131,072 context (docs/results/decode_curve_131k): V4.1-Flash's attention shape
    # (2 SWA layers, C2 then C1 from the YOCO boundary, window 128, indexer top-512 within 2048 candidate
    # entries) at the tiny width and with tiny's Engram / DSpark block (4 tokens: up to 3 drafts).
    "curve": dict(
        vocab_size=256, hidden_size=128, num_hidden_layers=8, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, moe_intermediate_size=64,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, sliding_window=128,
        compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0], kv_source_layer_ids=[2, 5, 7],
        index_source_layer_ids=[2, 4, 5, 7], candidate_source_layer_id=5, candidate_topk_blocks=256,
        candidate_block_size=8, index_n_heads=4, index_head_dim=32, index_topk=512, engram_layer_ids=[1, 3],
        engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=32, engram_vocab_size=97,
        engram_pad_token_id=2, engram_compressed_vocab_size=228, num_nextn_predict_layers=1, dspark_block_size=4,
        dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=16, dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2, dspark_noise_token_id=3, max_position_embeddings=262144,
        rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32,
                      "beta_slow": 1},
    ),
}
# The vision tower (vision_config + vision.* / aligner.* / image_* tensors): DeepInfer's ViT shape is fixed in
# vision_encoder/vit.py (patch 14, width 1024, 32 blocks, 16 heads, MLP 2.7x rounded up to 128; aligner
# downsample_mlp_gelu of depth 2); "tiny" keeps its names at a test-sized width. The image processor's settings
# (max_image_tokens, min_pixels, max_wh_ratio: DeepInfer's hugging_face/processor.py reads them from vision_config)
# are test values, not the released checkpoint's (which DeepInfer's source does not state).
VISION: dict[str, dict[str, int]] = {
    "deepinfer": dict(hidden_size=1024, depth=32, mlp_hidden=2816, patch_size=14, downsample_ratio=3,
                      num_attention_heads=16, max_image_tokens=1024, min_pixels=3136, max_wh_ratio=8),
    "tiny": dict(hidden_size=32, depth=2, mlp_hidden=64, patch_size=14, downsample_ratio=2, num_attention_heads=2,
                 max_image_tokens=32, min_pixels=784, max_wh_ratio=4),
}
# The image placeholder DeepInfer looks up in the tokenizer (multimodal_tokens.py CANDIDATE_IMAGE_PLACEHOLDER_TOKENS);
# the tiny char tokenizer's last filler token becomes it.
IMAGE_TOKEN = "<｜deepseek_image｜>"
COMMON = dict(hidden_act="silu", attention_bias=False, attention_dropout=0.0, num_key_value_heads=1,
              scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5,
              swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
              rope_theta=10000.0, compress_rope_theta=160000.0, tie_word_embeddings=False)
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


def _sources(ids: list[int], n: int) -> list[int]:
    return [max([s for s in ids if s <= i], default=i) for i in range(n)]


def _next_primes(text: dict[str, Any]) -> list[int]:
    """Engram table rows per layer: the sum of its distinct primes (the loader recomputes them)."""
    from sympy import nextprime

    seen: set[int] = set()
    rows = []
    for _ in text["engram_layer_ids"]:
        total = 0
        for _ in range(text["engram_max_ngram_size"] - 1):
            start = text["engram_vocab_size"] - 1
            for _ in range(text["engram_n_heads"]):
                p = int(nextprime(start))
                while p in seen:
                    p = int(nextprime(p))
                seen.add(p)
                total += p
                start = p
        rows.append(total)
    return rows


def tensor_specs(text: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """DeepInfer HF name -> (shape, kind); kind: fp8 | fp4 | table | bf16 | fp32 | norm | hc_fn | hc_base |
    hc_scale | sink."""
    d, n, e = text["hidden_size"], text["num_hidden_layers"], text["n_routed_experts"]
    kv = _sources(text["kv_source_layer_ids"], n)
    idx = _sources(text["index_source_layer_ids"], n)
    idxk = _sources(text.get("index_k_source_layer_ids") or text["kv_source_layer_ids"], n)
    specs: dict[str, tuple[tuple[int, ...], str]] = {
        "embed.weight": ((text["vocab_size"], d), "bf16"), "head.weight": ((text["vocab_size"], d), "bf16"),
        "norm.weight": ((d,), "norm")}
    engram_rows = dict(zip(text.get("engram_layer_ids") or [], _next_primes(text) if text.get("engram_layer_ids")
                           else []))
    for i in range(n):
        specs.update(_block_specs(text, f"layers.{i}.", e, text["compress_ratios"][i], kv[i] == i, idx[i] == i,
                                  idxk[i] == i, engram_rows.get(i)))
    nextn = text.get("num_nextn_predict_layers", 0)
    for j in range(nextn):  # DSpark draft blocks: sliding-window layers with their own (smaller) MoE
        p = f"mtp.{j}."
        specs.update(_block_specs(text, p, text["dspark_n_routed_experts"], 0, False, False, False, None))
        r = text["dspark_markov_rank"]
        if j == 0:
            specs.update({p + "main_proj.weight": ((d, len(text["dspark_target_layer_ids"]) * d), "fp8"),
                          p + "main_norm.weight": ((d,), "norm")})
        if j == nextn - 1:
            specs.update({p + "norm.weight": ((d,), "norm"),
                          p + "markov_head.embed.weight": ((text["vocab_size"], r), "bf16"),
                          p + "markov_head.head.weight": ((text["vocab_size"], r), "bf16"),
                          p + "confidence_head.proj.weight": ((1, d + r), "bf16")})
    return specs


def vision_specs(vision: dict[str, int], text_hidden: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """DeepInfer HF names of the vision tower (names.py maps them into vision_pipeline.aligner.*), bf16."""
    e, m, p, ds = vision["hidden_size"], vision["mlp_hidden"], vision["patch_size"], vision["downsample_ratio"]
    specs: dict[str, tuple[tuple[int, ...], str]] = {
        "vision.patch_embed.proj.weight": ((e, 3 * p * p), "bf16"), "vision.patch_embed.proj.bias": ((e,), "bf16"),
        "vision.norm.weight": ((e,), "norm"),
        "aligner.w1.weight": ((text_hidden, e * ds * ds), "bf16"), "aligner.w1.bias": ((text_hidden,), "bf16"),
        "aligner.w2.weight": ((text_hidden, text_hidden), "bf16"), "aligner.w2.bias": ((text_hidden,), "bf16"),
        **{f"image_{k}": ((text_hidden,), "bf16") for k in ("start", "end", "newline")}}
    for i in range(vision["depth"]):
        b = f"vision.blocks.{i}."
        specs.update({b + "norm1.weight": ((e,), "norm"), b + "norm2.weight": ((e,), "norm"),
                      b + "attn.wqkv.weight": ((3 * e, e), "bf16"), b + "attn.wqkv.bias": ((3 * e,), "bf16"),
                      b + "attn.wo.weight": ((e, e), "bf16"), b + "attn.wo.bias": ((e,), "bf16"),
                      b + "mlp.w1.weight": ((2 * m, e), "bf16"), b + "mlp.w2.weight": ((e, m), "bf16")})
    return specs


def _block_specs(text: dict[str, Any], p: str, e: int, r: int, kv_src: bool, idx_src: bool, idxk_src: bool,
                 engram_rows: int | None) -> dict[str, tuple[tuple[int, ...], str]]:
    """One decoder block's tensors (a main layer or a DSpark block), as DeepInfer's builder creates them."""
    d, h = text["hidden_size"], text["head_dim"]
    heads, hc, ql = text["num_attention_heads"], text["hc_mult"], text["q_lora_rank"]
    g, ol, inter = text["o_groups"], text["o_lora_rank"], text["moe_intermediate_size"]
    nih, dih = text["index_n_heads"], text["index_head_dim"]
    mix = (2 + hc) * hc
    s = {"attn_norm.weight": ((d,), "norm"), "ffn_norm.weight": ((d,), "norm"),
         "attn.attn_sink": ((heads,), "sink"), "attn.wq_a.weight": ((ql, d), "fp8"),
         "attn.q_norm.weight": ((ql,), "norm"), "attn.wq_b.weight": ((heads * h, ql), "fp8"),
         "attn.wkv.weight": ((h, d), "fp8"), "attn.kv_norm.weight": ((h,), "norm"),
         "attn.wo_a.weight": ((g * ol, heads * h // g), "fp8"), "attn.wo_b.weight": ((d, g * ol), "fp8"),
         "ffn.gate.weight": ((e, d), "bf16"), "ffn.gate.bias": ((e,), "fp32"), "ffn.gate.bias_vl": ((e,), "fp32"),
         "ffn.shared_experts.w1.weight": ((inter * text["n_shared_experts"], d), "fp8"),
         "ffn.shared_experts.w3.weight": ((inter * text["n_shared_experts"], d), "fp8"),
         "ffn.shared_experts.w2.weight": ((d, inter * text["n_shared_experts"]), "fp8")}
    for sub in ("attn", "ffn"):
        s.update({f"hc_{sub}_fn": ((mix, hc * d), "hc_fn"), f"hc_{sub}_base": ((mix,), "hc_base"),
                  f"hc_{sub}_scale": ((3,), "hc_scale")})
    for x in range(e):
        s.update({f"ffn.experts.{x}.w1.weight": ((inter, d), "fp4"), f"ffn.experts.{x}.w3.weight": ((inter, d), "fp4"),
                  f"ffn.experts.{x}.w2.weight": ((d, inter), "fp4")})
    if r and kv_src:
        s.update({"attn.compressor.wkv.weight": ((h, d), "bf16"), "attn.compressor.norm.weight": ((h,), "norm")})
        if r == 2:
            s["attn.compressor.wgate.weight"] = ((h, d), "bf16")
    if r and idx_src:
        s.update({"attn.indexer.wq_b.weight": ((nih * dih, ql), "fp8"),
                  "attn.indexer.weights_proj.weight": ((nih, d), "bf16")})
    if r and idxk_src:
        s.update({"attn.indexer.wk.weight": ((dih, h), "bf16"), "attn.indexer.k_norm.weight": ((dih,), "norm")})
    if engram_rows is not None:
        edim = (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"] * text["engram_head_dim"]
        s.update({"engram.embed.weight": ((engram_rows, text["engram_head_dim"]), "table"),
                  "engram.wkv.weight": ((d * (hc + 1), edim), "fp8"), "engram.q_weight": ((hc, d), "norm"),
                  "engram.k_weight": ((hc, d), "norm")})
    return {p + k: v for k, v in s.items()}


def make_checkpoint(out: str | Path, size: str = "tiny", seed: int = 0, std: float | None = None,
                    quantize: bool = True, vision: str | None = None, **overrides: Any) -> Path:
    """Write config.json, model.safetensors and a char tokenizer to ``out``; ``overrides`` replace text_config
    fields. ``quantize=False`` writes every tensor in fp32 without quantization_config (openinfer also loads that).
    ``vision`` (a VISION size) adds DeepInfer's vision layout: vision_config and the vision / image_* tensors."""
    from safetensors.torch import save_file

    text = {**COMMON, **SIZES[size], **overrides}
    std = std if std is not None else (0.08 if size in ("tiny", "curve") else 0.02)
    gen = torch.Generator().manual_seed(seed)

    def randn(shape, s, mean=0.0):
        return torch.randn(shape, generator=gen) * s + mean

    tensors: dict[str, torch.Tensor] = {}
    specs = tensor_specs(text)
    if vision is not None:
        specs.update(vision_specs(VISION[vision], text["hidden_size"]))
    for name, (shape, kind) in specs.items():
        if kind == "norm":
            t = randn(shape, 0.1, 1.0)
        elif kind == "hc_fn":
            t = randn(shape, 0.05)
        elif kind in ("hc_base", "sink"):
            t = randn(shape, 0.5)
        elif kind == "hc_scale":
            t = randn(shape, 0.3, 1.0)
        elif kind == "fp32":
            t = randn(shape, 0.1)
        elif kind == "table":
            t = randn(shape, 0.5)
        else:
            t = randn(shape, std)
        if not quantize:
            tensors[name] = t
        elif kind == "fp8":
            tensors[name], tensors[name.removesuffix(".weight") + ".scale"] = quantize_fp8_block(t, (32, 32), "ue8m0")
        elif kind == "table":
            tensors[name], tensors[name.removesuffix(".weight") + ".scale"] = quantize_fp8_block(t, (1, 32), "ue8m0")
        elif kind == "fp4":
            tensors[name], tensors[name.removesuffix(".weight") + ".scale"] = quantize_mxfp4(t)
        elif kind in ("bf16", "norm"):
            tensors[name] = t.to(torch.bfloat16)
        else:
            tensors[name] = t.float()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    cfg = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
           "dtype": "bfloat16" if quantize else "float32", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
           "text_config": text}
    if quantize:
        cfg["quantization_config"] = dict(QUANTIZATION)
    if vision is not None:
        v = VISION[vision]
        cfg["vision_config"] = {"hidden_size": v["hidden_size"], "downsample_ratio": v["downsample_ratio"],
                                "num_hidden_layers": v["depth"], "num_attention_heads": v["num_attention_heads"],
                                "patch_size": v["patch_size"], "intermediate_size": v["mlp_hidden"],
                                "max_image_tokens": v["max_image_tokens"], "min_pixels": v["min_pixels"],
                                "max_wh_ratio": v["max_wh_ratio"]}
        cfg["image_token_id"] = text["vocab_size"] - 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_char_tokenizer(out, text["vocab_size"])
    if vision is not None:
        add_image_token(out, text["vocab_size"] - 1)
    return out


def add_image_token(out: Path, token_id: int) -> None:
    """Rename filler token ``token_id`` of the char tokenizer to the image placeholder, as a special token (matched
    whole in text, before the character split)."""
    path = out / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    old = next(t for t, i in vocab.items() if i == token_id)
    del vocab[old]
    vocab[IMAGE_TOKEN] = token_id
    tok["added_tokens"].append({"id": token_id, "content": IMAGE_TOKEN, "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    path.write_text(json.dumps(tok, ensure_ascii=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-quantize", action="store_true", help="fp32 tensors, no quantization_config")
    ap.add_argument("--vision", choices=sorted(VISION), default=None,
                    help="also write the vision tower (vision_config, vision.* / aligner.* / image_* tensors)")
    args = ap.parse_args()
    path = make_checkpoint(args.out, args.size, args.seed, quantize=not args.no_quantize, vision=args.vision)
    print(f"wrote {args.size} DeepSeek-V4.1 checkpoint to {path}")


if __name__ == "__main__":
    main()
