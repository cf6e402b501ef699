"""Turn a bf16 / fp32 HF-shaped Llama / Qwen checkpoint into a low-bit one in a format people publish, with the
tensors and ``config.json`` ``quantization_config`` that llm-compressor / AutoGPTQ write (issue 16):

- ``w8a8``: compressed-tensors ``int-quantized`` (llm-compressor's W8A8 int8 scheme): ``X.weight`` int8 [N, K],
  ``X.weight_scale`` [N, 1] per output channel (scale = amax / 127.5, q = round(w / scale) clamped to [-128, 127],
  compressed-tensors' symmetric min-max arithmetic), activations declared per token, dynamic, symmetric.
- ``w4a16``: compressed-tensors ``pack-quantized`` (W4A16): ``X.weight_packed`` int32 [N, K / 8] (q + 8 in nibbles,
  column 8 j + i at bits 4 i of word j), ``X.weight_scale`` [N, K / group] (amax / 7.5, q in [-8, 7]),
  ``X.weight_shape`` int64 [2].
- ``gptq``: AutoGPTQ's v1 format, 4-bit, sym, no desc_act: ``X.qweight`` int32 [K / 8, N], ``X.qzeros`` int32
  [K / group, N / 8] (zero - 1 = 7 per nibble), ``X.scales`` fp16 [K / group, N] (2 amax / 15), ``X.g_idx`` int32
  [K]. The values are rounded to nearest: GPTQ's Hessian-based error compensation is an offline calibration step
  that changes which integers are stored, not the format, and it needs calibration data we do not ship.
- ``gptq-asym``: the same with ``sym: false``: per group s = (max - min) / 15 (max >= 0 >= min, AutoGPTQ's
  quantizer), zero z = round(-min / s), q = clamp(round(w / s) + z, 0, 15), w = (q - z) s; qzeros hold z - 1.
- ``awq``: AutoAWQ's ``gemm`` version: ``X.qweight`` int32 [K, N / 8] packed along N in AWQ's nibble order
  (``AWQ_ORDER``), ``X.qzeros`` int32 [K / group, N / 8] (z, same order), ``X.scales`` fp16 [K / group, N]; per group
  s = (max - min) / 15, z = clamp(round(-min / s), 0, 15), q = clamp(round(w / s) + z, 0, 15) (AutoAWQ's
  zero-point quantizer; its activation-aware scale search is calibration, like GPTQ's, and is not done here).

The decoder layers' projections (q/k/v/o, gate/up/down) are quantised; embeddings, norms and ``lm_head`` stay in the
source dtype (``ignore: ["lm_head"]``, as llm-compressor's recipes do). Tokenizer and other files are copied.

    python scripts/make_quantized_checkpoint.py --src .bench/llama-200m --dst .bench/llama-200m-w8a8 --format w8a8
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from openinfer.layers.checkpoint_quant import AWQ_ORDER

FORMATS = ("w8a8", "w4a16", "gptq", "gptq-asym", "awq")
_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_target(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _TARGETS and ".layers." in name


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit patterns -> int32 with the same bits."""
    return ((words + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)


def pack_nibbles_int32(nibbles: torch.Tensor) -> torch.Tensor:
    """uint 0..15 values [N, K] -> int32 words [N, ceil(K / 8)] (nibble i at bits 4 i), padded with zeros."""
    v = nibbles.to(torch.int64)
    n, k = v.shape
    kp = -(-k // 8) * 8
    v = torch.nn.functional.pad(v, (0, kp - k)).view(n, kp // 8, 8)
    return _to_int32((v << (torch.arange(8, dtype=torch.int64) * 4)).sum(dim=2))


def quantize_w8a8(w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.5).to(dtype)
    scale = torch.where(scale.float() > 0, scale, torch.ones_like(scale))  # all-zero rows: q = 0 with any scale
    s = scale.float()  # quantise with the scale as stored, so dequantising the file reproduces the rounding
    return {"weight": torch.round(w / s).clamp(-128, 127).to(torch.int8), "weight_scale": scale}


def _group_scales(w: torch.Tensor, group: int, qdiv: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, group of K) scales in ``dtype`` and the same widened per column, for w [N, K]."""
    n, k = w.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(w.float(), (0, groups * group - k))
    scale = (padded.view(n, groups, group).abs().amax(dim=2) / qdiv).to(dtype)
    scale = torch.where(scale.float() > 0, scale, torch.ones_like(scale))
    return scale, scale.float().repeat_interleave(group, dim=1)[:, :k]


def quantize_w4a16(w: torch.Tensor, group: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    scale, s = _group_scales(w, group, 7.5, dtype)
    q = torch.round(w.float() / s).clamp(-8, 7).to(torch.int64)
    return {"weight_packed": pack_nibbles_int32(q + 8), "weight_scale": scale,
            "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}


def quantize_gptq(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    n, k = w.shape
    if k % group or k % 8 or n % 8:
        raise ValueError(f"GPTQ needs K ({k}) divisible by group_size ({group}) and by 8, and N ({n}) by 8")
    scale, s = _group_scales(w, group, 7.5, torch.float16)  # AutoGPTQ sym: (2 amax) / 15
    q = (torch.round(w.float() / s) + 8).clamp(0, 15).to(torch.int64)  # zero = 8
    return {"qweight": pack_nibbles_int32(q).t().contiguous(),  # [K / 8, N]: packed along K
            "qzeros": pack_nibbles_int32(torch.full((k // group, n), 7, dtype=torch.int64)),
            "scales": scale.t().contiguous(),
            "g_idx": (torch.arange(k) // group).to(torch.int32)}


def _asym_groups(w: torch.Tensor, group: int, with_zero: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit per (row, group of K) for w [N, K] (K a multiple of ``group``): (q int64
    [N, K] in 0..15, z int64 [N, K / group] in 0..15, s fp16 [N, K / group]); w ~ (q - z) s. ``with_zero``: the
    range includes 0 (AutoGPTQ's quantizer) rather than only the group's own min / max (AutoAWQ's)."""
    n, k = w.shape
    wg = w.float().view(n, k // group, group)
    mx, mn = wg.amax(dim=2), wg.amin(dim=2)
    if with_zero:
        mx, mn = mx.clamp(min=0), mn.clamp(max=0)
    scale = ((mx - mn).clamp(min=1e-5) / 15).to(torch.float16)  # AutoAWQ clamps the range at 1e-5 too
    s = scale.float()  # quantise with the scale as stored, so dequantising the file reproduces the rounding
    z = torch.round(-mn / s).clamp(0, 15)
    q = (torch.round(wg / s[..., None]) + z[..., None]).clamp(0, 15)
    return q.view(n, k).to(torch.int64), z.to(torch.int64), scale


def quantize_gptq_asym(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    n, k = w.shape
    if k % group or k % 8 or n % 8:
        raise ValueError(f"GPTQ needs K ({k}) divisible by group_size ({group}) and by 8, and N ({n}) by 8")
    q, z, scale = _asym_groups(w, group, with_zero=True)
    if bool((z == 0).any()):  # v1 stores z - 1 in an unsigned nibble: z = 0 would read back as 16
        raise ValueError("a group's zero point is 0 (its values are all >= 0), which GPTQ v1 cannot store")
    return {"qweight": pack_nibbles_int32(q).t().contiguous(),
            "qzeros": pack_nibbles_int32((z - 1).t().contiguous()),  # [K / group, N / 8]
            "scales": scale.t().contiguous(),
            "g_idx": (torch.arange(k) // group).to(torch.int32)}


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """uint 0..15 [R, C] (C a multiple of 8) -> AWQ's int32 [R, C / 8]: word j holds column 8 j + AWQ_ORDER[i] at
    bits 4 i."""
    r, c = values.shape
    v = values.to(torch.int64).view(r, c // 8, 8)[:, :, list(AWQ_ORDER)]
    return _to_int32((v << (torch.arange(8, dtype=torch.int64) * 4)).sum(dim=2))


def quantize_awq(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    n, k = w.shape
    if k % group or n % 8:
        raise ValueError(f"AWQ needs K ({k}) divisible by group_size ({group}) and N ({n}) by 8")
    q, z, scale = _asym_groups(w, group, with_zero=False)
    return {"qweight": pack_awq(q.t().contiguous()),  # [K, N / 8]: packed along N
            "qzeros": pack_awq(z.t().contiguous()),  # [K / group, N / 8]
            "scales": scale.t().contiguous()}  # [K / group, N]


def quantization_config(fmt: str, group: int) -> dict:
    if fmt in ("gptq", "gptq-asym"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": fmt == "gptq",
                "damp_percent": 0.01, "static_groups": False, "true_sequential": True, "lm_head": False,
                "checkpoint_format": "gptq"}
    if fmt == "awq":  # AutoAWQ's save_quantized config
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if fmt == "w8a8":
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                   "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
                   "observer_kwargs": {}}
        acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
                "group_size": None, "block_structure": None, "actorder": None, "observer": None,
                "observer_kwargs": {}}
        ct_format = "int-quantized"
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "dynamic": False,
                   "group_size": group, "block_structure": None, "actorder": None, "observer": "minmax",
                   "observer_kwargs": {}}
        acts = None
        ct_format = "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": ct_format, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None, "format": ct_format}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None}


def convert(src: str | Path, dst: str | Path, fmt: str, group: int = 128) -> Path:
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r}; choose one of {', '.join(FORMATS)}")
    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise ValueError(f"{src} is already quantised")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # tokenizer, generation config, ...
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not _is_target(name):
            out[name] = t.contiguous()
            continue
        prefix = name[:-len(".weight")]
        if fmt == "w8a8":
            parts = quantize_w8a8(t, t.dtype)
        elif fmt == "w4a16":
            parts = quantize_w4a16(t, group, t.dtype)
        elif fmt == "gptq":
            parts = quantize_gptq(t, group)
        elif fmt == "gptq-asym":
            parts = quantize_gptq_asym(t, group)
        else:
            parts = quantize_awq(t, group)
        out.update({f"{prefix}.{k}": v.contiguous() for k, v in parts.items()})
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = quantization_config(fmt, group)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="a bf16 / fp32 HF-shaped checkpoint folder")
    ap.add_argument("--dst", required=True)
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--group-size", type=int, default=128, help="w4a16 / gptq / awq: input columns per scale")
    a = ap.parse_args()
    print(convert(a.src, a.dst, a.format, a.group_size))


if __name__ == "__main__":
    main()
