"""Write a random DeepSeek-V4-shaped HF checkpoint (config, safetensors, char tokenizer) with transformers'
``DeepseekV4ForCausalLM.save_pretrained``, so tensor names are exactly the ones transformers writes.

  python scripts/make_deepseek_v4_checkpoint.py --size tiny  --out /tmp/v4-tiny    # ~1M params, tests
  python scripts/make_deepseek_v4_checkpoint.py --size bench --out /tmp/v4-bench   # ~200M params, benchmarks
  python scripts/make_deepseek_v4_checkpoint.py --size tiny --out /tmp/v4-fp8 --quantize release-fp4

``--quantize`` writes the weights the way DeepSeek ships V4 (``quantize_checkpoint``): ``release-fp4`` =
V4-Flash (unprefixed names, FP8 linears with UE8M0 ``.scale``, MXFP4 experts), ``hf-fp8`` = V4-Flash-Base converted by
HF (``model.`` names, FP8 linears and experts with fp32 ``weight_scale_inv``).

Weights are drawn with a larger std than HF's init (and the mHC / sink / ape / gate-bias / tid2eid tensors, which
HF initialises to constants, are randomised) so that logits spread out and greedy ties are unlikely.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from openinfer.layers.fp8 import quantize_fp8_block  # noqa: E402
from openinfer.layers.mxfp4 import quantize_mxfp4  # noqa: E402
from openinfer.utils.char_tokenizer import write_char_tokenizer  # noqa: E402

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

SIZES: dict[str, dict[str, Any]] = {
    # Spec §10 shape, narrower: 4 layers [SWA, HCA, CSA, HCA], window 16, CSA 4 / HCA 16, hash MoE on layer 0.
    "tiny": dict(
        vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, moe_intermediate_size=64,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, layer_types=[SWA, HCA, CSA, HCA],
        compress_rates={CSA: 4, HCA: 16}, mlp_layer_types=["hash_moe", "moe", "moe", "moe"], sliding_window=16,
        index_n_heads=16, index_head_dim=32, index_topk=8, max_position_embeddings=1024,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                      "beta_fast": 32, "beta_slow": 1},
    ),
    # V4-Flash's layer pattern and ratios (2 SWA layers, then CSA/HCA alternating, window 128, HCA 128, 3 hash
    # layers) at ~1/20 of its width: ~200M parameters, 16 experts of which 6 active.
    "bench": dict(
        vocab_size=8192, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, head_dim=128,
        qk_rope_head_dim=32, q_lora_rank=384, o_groups=4, o_lora_rank=256, moe_intermediate_size=384,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=6,
        layer_types=[SWA, SWA, CSA, HCA, CSA, HCA, CSA, HCA], compress_rates={CSA: 4, HCA: 128},
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 5, sliding_window=128, index_n_heads=16,
        index_head_dim=64, index_topk=64, max_position_embeddings=16384,
        rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32, "beta_slow": 1},
    ),
    # For decode curves out to 131,072 context (docs/results/decode_curve_131k): V4-Flash's attention shape
    # (2 SWA layers then CSA 4 / HCA 128 alternating, window 128, indexer top-512, YaRN 16 over 65,536,
    # 3 hash layers) at the tiny width, so a 131k prefix prefills in minutes on a CPU.
    "curve": dict(
        vocab_size=256, hidden_size=128, num_hidden_layers=6, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, moe_intermediate_size=64,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        layer_types=[SWA, SWA, CSA, HCA, CSA, HCA], compress_rates={CSA: 4, HCA: 128},
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 3, sliding_window=128, index_n_heads=4,
        index_head_dim=32, index_topk=512, max_position_embeddings=262144,
        rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
    ),
}


@torch.no_grad()
def randomize(model: torch.nn.Module, vocab_size: int, top_k: int, num_experts: int, std: float,
              seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)

    def randn(p: torch.Tensor, s: float, mean: float = 0.0) -> None:
        p.normal_(mean, s, generator=gen)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name:
            randn(p, 0.1, 1.0)
        elif leaf in ("scale", "hc_scale"):
            randn(p, 0.3, 1.0)
        elif leaf in ("base", "hc_base", "sinks", "position_bias"):
            randn(p, 0.5)
        elif leaf in ("fn", "hc_fn"):
            randn(p, 0.05)
        else:
            randn(p, std)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):  # distinct experts per token, like the released tables
            b.copy_(torch.rand(vocab_size, num_experts, generator=gen).argsort(dim=-1)[:, :top_k])
        elif name.endswith("e_score_correction_bias"):
            randn(b, 0.1)


def make_checkpoint(out: str | Path, size: str = "tiny", seed: int = 0, std: float | None = None,
                    dtype: torch.dtype | None = None, **overrides: Any) -> Path:
    """Write the checkpoint and a char tokenizer to ``out``; returns the path. ``overrides`` replace config kwargs."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.initialization import no_init_weights


    kw = dict(SIZES[size], bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    kw.update(overrides)
    cfg = DeepseekV4Config(**kw)
    with no_init_weights():  # randomize() overwrites every parameter; HF's own init would double the cost
        model = DeepseekV4ForCausalLM._from_config(cfg, dtype=dtype or torch.float32).eval()
    if std is None:
        std = 0.08 if size in ("tiny", "curve") else 0.02
    randomize(model, cfg.vocab_size, cfg.num_experts_per_tok, cfg.n_routed_experts, std, seed)
    out = Path(out)
    model.save_pretrained(str(out))
    write_char_tokenizer(out, cfg.vocab_size)
    return out


# The linears DeepSeek ships in FP8 (spec §3, §4.8); compressor, indexer weights_proj, gate, embed, head and
# norms stay unquantised. Routed experts follow expert_dtype.
FP8_LINEAR = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|shared_experts\.w[123]"
                        r"|[eh]_proj)\.weight$")
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
QUANT_FORMATS = {  # name -> (naming, scale suffix, FP8 scale format, expert_dtype)
    "release-fp4": ("release", ".scale", "ue8m0", "fp4"),
    "hf-fp8": ("hf", ".weight_scale_inv", "float32", "fp8"),
}


def quantize_checkpoint(src: str | Path, out: str | Path, fmt: str = "release-fp4",
                        block: tuple[int, int] = (128, 128)) -> Path:
    """Write ``src`` (a make_checkpoint output) quantised in one of QUANT_FORMATS; the config stays HF-style
    plus ``quantization_config`` and ``expert_dtype``. Returns ``out``."""
    from safetensors.torch import load_file, save_file

    naming, suffix, scale_fmt, expert_dtype = QUANT_FORMATS[fmt]
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if naming == "release":
                name = name.removeprefix("model.").replace("hc_head.hc_", "hc_head_")
                name = "embed.weight" if name == "embed_tokens.weight" else name
            if ROUTED_EXPERT.search(name) and expert_dtype == "fp4":
                q, scale = quantize_mxfp4(t)
            elif FP8_LINEAR.search(name) or ROUTED_EXPERT.search(name):
                q, scale = quantize_fp8_block(t, block, scale_fmt)
            else:
                tensors[name] = t
                continue
            tensors[name] = q
            tensors[name.removesuffix(".weight") + suffix] = scale
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "scale_fmt": scale_fmt}
    cfg["expert_dtype"] = expert_dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model.safetensors"):
            shutil.copy(f, out / f.name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="default: float32 for tiny, bfloat16 for bench")
    ap.add_argument("--quantize", choices=sorted(QUANT_FORMATS), default=None,
                    help="write the weights quantised the way DeepSeek ships them (see the module docstring)")
    args = ap.parse_args()
    dtype = args.dtype or ("float32" if args.size == "tiny" else "bfloat16")
    if args.quantize:
        plain = make_checkpoint(Path(args.out) / "unquantised", args.size, args.seed,
                                dtype=getattr(torch, dtype))
        path = quantize_checkpoint(plain, args.out, args.quantize)
        shutil.rmtree(plain)
    else:
        path = make_checkpoint(args.out, args.size, args.seed, dtype=getattr(torch, dtype))
    from safetensors import safe_open

    n = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            n += sum(_numel(h.get_slice(k).get_shape()) for k in h.keys())
    print(f"wrote {args.size} DeepSeek-V4 checkpoint ({n / 1e6:.1f}M parameters, {dtype}) to {path}")


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

if __name__ == "__main__":
    main()
