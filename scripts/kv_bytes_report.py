"""Print the KV bytes per token openinfer reports for model configs, without weights (models are built on
the meta device). Usage: python scripts/kv_bytes_report.py CONFIG.json [...] [--dtype bfloat16] [--block-size 16]

The figures are the ones the engine logs at start-up (kv_cache_interface.kv_bytes_summary)."""
from __future__ import annotations

import argparse
import json

import torch

from openinfer.kv_cache_interface import kv_bytes_summary
from openinfer.models.registry import resolve_model_class


def report(hf_config: dict, dtype: torch.dtype, block_size: int) -> str:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = resolve_model_class(hf_config["architectures"][0])(hf_config)
    finally:
        torch.set_default_dtype(prev)
    return kv_bytes_summary(model.kv_cache_spec(block_size, dtype), block_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    for path in args.configs:
        cfg = json.loads(open(path).read())
        print(f"{path}: {cfg['architectures'][0]}: {report(cfg, getattr(torch, args.dtype), args.block_size)}")


if __name__ == "__main__":
    main()
