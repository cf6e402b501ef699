"""The offline workload flags shared by ``bench throughput`` and ``bench peers``, and their validation.

Two modes:

* ``e2e`` (default): ``batch`` requests of ``--input-len`` prompt tokens each generate ``--output-len``
  tokens; the whole call is timed, prefill included (vLLM ``bench throughput``).
* ``decode``: ``batch`` requests are prefilled untimed to ``--context-len`` tokens of KV, then exactly
  ``--decode-steps`` steps in which every sequence decodes one token are timed: the steady-state decode rate
  at a fixed batch and context, as decode curves are drawn.

``--context-len`` and ``--input-len`` name one quantity, the prompt length (= the KV each request holds
when its decoding starts): either flag sets it, both must agree when both are given.
"""
from __future__ import annotations

import argparse
import math
from typing import Any

from openinfer.engine_args import EngineArgs

MODES = ("e2e", "decode")
DEFAULT_PROMPT_LEN = 128
DEFAULT_OUTPUT_LEN = 128
DEFAULT_DECODE_STEPS = 32
# Tokens past the timed window a decode-mode request may still hold: its first token (sampled at prefill)
# and one more, so the window's last step is a plain decode step, not one that also finishes the request.
DECODE_TAIL_TOKENS = 2


def add_workload_args(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p)
    # An explicit dtype so every engine runs the same one; max_num_seqs follows the largest batch unless set.
    p.set_defaults(dtype="bfloat16", max_num_seqs=None, _bench_parser=p)
    for action in p._actions:
        if action.dest == "max_num_seqs":
            action.help = "most requests running at once (default: the largest --batch-sizes)"
    g = p.add_argument_group("workload")
    g.add_argument("--mode", choices=MODES, default="e2e",
                   help="e2e: time whole generate calls, prefill included (default); decode: time "
                        "--decode-steps steps of pure decode at --context-len")
    g.add_argument("--input-len", type=int, default=None,
                   help=f"prompt tokens per request (default {DEFAULT_PROMPT_LEN}); same as --context-len")
    g.add_argument("--context-len", type=int, default=None,
                   help="KV tokens each request holds when its decoding starts, i.e. the prompt length "
                        "(default: --input-len)")
    g.add_argument("--output-len", type=int, default=None,
                   help=f"e2e mode: generated tokens per request, EOS ignored (default {DEFAULT_OUTPUT_LEN})")
    g.add_argument("--decode-steps", type=int, default=None,
                   help=f"decode mode: timed decode steps per iteration (default {DEFAULT_DECODE_STEPS})")
    g.add_argument("--shared-prefix-len", type=int, default=0,
                   help="decode mode: the first N of each request's --context-len prompt tokens are one seeded "
                        "prefix shared by the whole batch, prefilled once (untimed) and then hit in the prefix "
                        "cache, so each request computes only its distinct tail; the KV each request reads per "
                        "step is unchanged, the prefill is paid once (default 0: nothing shared)")
    g.add_argument("--batch-sizes", default="1,8,32,64,128,256", help="comma-separated requests per point")
    g.add_argument("--num-iters", type=int, default=3, help="timed iterations per point (median reported)")
    g.add_argument("--warmup-iters", type=int, default=1, help="untimed iterations per point")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default, matches HF do_sample=False); vLLM's bench uses 1.0")
    g.add_argument("--num-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    g.add_argument("--num-devices", type=int, default=None,
                   help="devices the deployment uses; recorded, and divides every *_per_device rate "
                        "(default: the engine's ranks, tensor_parallel_size x data_parallel_size)")
    g.add_argument("--hf-max-batch", type=int, default=64, help="largest batch the HF side runs")
    g.add_argument("--hf-experts-implementation", default=None, choices=["eager", "grouped_mm", "batched_mm"],
                   help="transformers' MoE experts backend (its default in 5.22 is grouped_mm; eager is the "
                        "per-expert Python loop)")


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--batch-sizes needs positive integers, got {text!r}")
    return sizes


def parse_speculative_config(text: str | None) -> dict[str, Any] | None:
    """The engine's --speculative-config (engine_args.py), validated, as the workload records it."""
    import dataclasses

    from openinfer.config import SpeculativeConfig

    try:
        value = SpeculativeConfig.parse(text)
    except ValueError as e:
        raise ValueError(f"--speculative-config: {e}") from None
    return dataclasses.asdict(value) if value is not None else None


def resolve_workload(args: argparse.Namespace) -> list[int]:
    """Validate the workload flags and fill the defaults in place; returns the sorted batch sizes.
    Every message names the flag and the limit it broke."""
    batches = parse_batch_sizes(args.batch_sizes)
    if args.input_len is not None and args.context_len is not None and args.input_len != args.context_len:
        raise ValueError(f"--context-len {args.context_len} and --input-len {args.input_len} disagree: both "
                         f"are the prompt length (the KV each request holds when decoding starts); give one")
    length = args.context_len if args.context_len is not None else args.input_len
    args.input_len = args.context_len = DEFAULT_PROMPT_LEN if length is None else length
    if args.mode == "decode":
        if args.output_len is not None:
            raise ValueError("--output-len applies to --mode e2e; in --mode decode the timed window is "
                             "--decode-steps long")
        if args.decode_steps is None:
            args.decode_steps = DEFAULT_DECODE_STEPS
    else:
        if args.decode_steps is not None:
            raise ValueError("--decode-steps applies to --mode decode; in --mode e2e use --output-len")
        if args.output_len is None:
            args.output_len = DEFAULT_OUTPUT_LEN
    if args.num_devices is None:
        args.num_devices = (getattr(args, "tensor_parallel_size", 1) or 1) * (getattr(args, "data_parallel_size", 1)
                                                                               or 1)
    if args.shared_prefix_len:
        if args.mode != "decode":
            raise ValueError("--shared-prefix-len applies to --mode decode (e2e mode measures prefill, which a "
                             "shared prefix would skip)")
        if not 0 < args.shared_prefix_len < args.context_len:
            raise ValueError(f"--shared-prefix-len must be in [0, --context-len {args.context_len}), got "
                             f"{args.shared_prefix_len}: each request needs a distinct tail")
    checks = [("context-len", args.context_len, 1), ("num-iters", args.num_iters, 1),
              ("warmup-iters", args.warmup_iters, 0), ("num-devices", args.num_devices, 1),
              ("hf-max-batch", args.hf_max_batch, 1)]
    checks.append(("decode-steps", args.decode_steps, 1) if args.mode == "decode"
                  else ("output-len", args.output_len, 1))
    for flag, value, low in checks:
        if value < low:
            raise ValueError(f"--{flag} must be >= {low}, got {value}")
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError(f"--num-threads must be >= 1, got {args.num_threads}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    args.speculative_config_value = parse_speculative_config(getattr(args, "speculative_config", None))
    if args.max_model_len is not None:
        check_fits(args, args.max_model_len, "--max-model-len")
    return batches


def tokens_needed(args: argparse.Namespace) -> int:
    """Sequence length one request reaches: prompt + output (e2e), or context + window + tail (decode)."""
    if args.mode == "decode":
        return args.context_len + args.decode_steps * tokens_per_step(args) + DECODE_TAIL_TOKENS
    return args.input_len + args.output_len


def tokens_per_step(args: argparse.Namespace) -> int:
    """The most tokens one decode step can add to a request: 1, or 1 + the drafts a verification can accept."""
    spec = getattr(args, "speculative_config_value", None)
    if not spec:
        return 1
    return 1 + spec["num_speculative_tokens"]


def check_fits(args: argparse.Namespace, limit: int, source: str) -> None:
    need = tokens_needed(args)
    if need <= limit:
        return
    if args.mode == "decode":
        per = tokens_per_step(args)
        steps = f"--decode-steps {args.decode_steps}" + (f" x {per} (1 + num_speculative_tokens)" if per > 1 else "")
        raise ValueError(
            f"--context-len {args.context_len} + {steps} + {DECODE_TAIL_TOKENS} = "
            f"{need} exceeds {source} {limit} (the {DECODE_TAIL_TOKENS} are the token sampled at prefill and "
            f"one more, so no request stops inside the timed window)")
    raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} = {need} exceeds "
                     f"{source} {limit}")
