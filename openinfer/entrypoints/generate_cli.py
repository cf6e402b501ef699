"""``openinfer generate``: offline generation from the command line."""
from __future__ import annotations

import argparse
import json

from openinfer import vllm_compat
from openinfer.engine_args import EngineArgs


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=None, help="default: generation_config.json, else 1.0")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--logprobs", type=int, default=None)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline",
                       description="Generate completions offline (vLLM-style LLM.generate).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per output")
    EngineArgs.add_cli_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def sampling_params_from_args(args: argparse.Namespace, defaults):
    from openinfer.sampling_params import SamplingParams

    kw = {
        "max_tokens": args.max_tokens, "min_tokens": args.min_tokens, "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty, "seed": args.sampling_seed, "stop": args.stop,
        "ignore_eos": args.ignore_eos, "n": args.n, "logprobs": args.logprobs,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        v = getattr(args, name)
        kw[name] = getattr(defaults, name) if v is None else v
    return SamplingParams(**kw)


def run(args: argparse.Namespace) -> int:
    from openinfer import LLM
    from openinfer.assets_path import default_model_path
    from openinfer.tokenizer import default_sampling_params

    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    else:
        prompts = args.prompt or ["The list object"]
    # Sampling flags are checked before the model loads, so a typo fails in a second, not after loading.
    params = sampling_params_from_args(args, default_sampling_params(args.model or default_model_path()))
    vllm_compat.log_noops(args)  # one line per vLLM flag accepted as a no-op
    llm = LLM(**EngineArgs.from_cli_args(args).to_dict())  # logs the KV-cache summary line
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason,
                                  "num_cached_tokens": out.num_cached_tokens}))
            else:
                print(f"--- prompt: {prompt!r}" + (f" [{c.index}]" if len(out.outputs) > 1 else ""))
                print(f"{prompt}{c.text}" if not args.chat else c.text)
                print(f"    ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    return 0
