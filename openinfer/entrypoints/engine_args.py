"""Engine flags shared by every command that builds an engine (generate, serve, bench)."""
from __future__ import annotations

import argparse
from typing import Any


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF-format model folder (default: the embedded demo model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    g.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32")
    g.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when present)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV block count (overrides memory)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--attention-backend", default="auto", help="auto | sdpa | reference")
    g.add_argument("--chat-template", default=None, help="a jinja2 template string or file")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching, kv_cache_memory_gb=args.kv_cache_memory_gb,
        num_kv_blocks=args.num_kv_blocks, seed=args.seed, attention_backend=args.attention_backend,
        chat_template=args.chat_template,
    )


def engine_config_from_args(args: argparse.Namespace):
    """An ``EngineConfig`` (and the chat template) for commands that drive ``LLMEngine`` directly."""
    from openinfer.assets_path import default_model_path
    from openinfer.config import EngineConfig

    kw = engine_kwargs(args)
    chat_template = kw.pop("chat_template")
    kw["model"] = kw["model"] or default_model_path()
    model = kw.pop("model")
    return EngineConfig.create(model, **kw), chat_template
