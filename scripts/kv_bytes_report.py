"""Print the KV bytes per token openinfer reports for model configs, without weights (models are built on
the meta device). Usage: python scripts/kv_bytes_report.py CONFIG.json|CHECKPOINT_DIR [...] [--dtype bfloat16]
[--block-size 16] [--kv-cache-dtype auto fp8 ...]

The figures are the ones the engine logs at start-up (kv_cache_interface.kv_bytes_summary); with several
--kv-cache-dtype values each config gets a line per value and the ratio to the first."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from openinfer.kv_cache_interface import bytes_per_token, kv_bytes_summary
from openinfer.layers.kv_quant import FP8_DTYPE
from openinfer.models.registry import resolve_model_class


def _spec(hf_config: dict, dtype: torch.dtype, block_size: int, kv_cache_dtype: str = "auto"):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = resolve_model_class(hf_config["architectures"][0])(hf_config)
    finally:
        torch.set_default_dtype(prev)
    model.use_kv_cache_dtype(kv_cache_dtype)  # as the model runner does after load
    # what the model runner hands kv_cache_spec: the model's dtype, or float8_e4m3fn for an fp8 cache
    return model.kv_cache_spec(block_size, dtype if kv_cache_dtype == "auto" else FP8_DTYPE)


def report(hf_config: dict, dtype: torch.dtype, block_size: int, kv_cache_dtype: str = "auto") -> str:
    return kv_bytes_summary(_spec(hf_config, dtype, block_size, kv_cache_dtype), block_size)


def report_bytes(hf_config: dict, dtype: torch.dtype, block_size: int, kv_cache_dtype: str = "auto") -> int:
    """The whole-life bytes per token (the first figure of ``report``)."""
    return bytes_per_token(_spec(hf_config, dtype, block_size, kv_cache_dtype), block_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    for path in args.configs:
        p = Path(path)
        cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
        first = None
        for kvd in args.kv_cache_dtype:
            n = report_bytes(cfg, dtype, args.block_size, kvd)
            first = first or n
            ratio = f" ({n / first:.3f}x of {args.kv_cache_dtype[0]})" if len(args.kv_cache_dtype) > 1 else ""
            print(f"{path}: {cfg['architectures'][0]} kv_cache_dtype={kvd}: "
                  f"{report(cfg, dtype, args.block_size, kvd)}{ratio}")


if __name__ == "__main__":
    main()
