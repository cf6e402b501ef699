"""Structured outputs' cost: decode tokens/s at batch 1 and 32 with and without a JSON schema (same prompts,
greedy, fixed output length: the schema's array cannot close before max_tokens).

    python scripts/bench_structured_outputs.py --model .bench/llama-200m --batch-sizes 1,32 --output-len 64 \
        [--backend llguidance|xgrammar]
"""
from __future__ import annotations

import argparse
import json
import time

from openinfer import LLM, SamplingParams
from openinfer.sampling_params import StructuredOutputsParams

# At least 50 items of >= 3 characters: never complete within the measured output length.
SCHEMA = {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 8}, "minItems": 50}


def run(llm: LLM, batch: int, output_len: int, constrained: bool) -> float:
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, structured_outputs=so)
    prompts = [f"list {i}: " + "word " * 16 for i in range(batch)]
    llm.generate(prompts[:1], sp, use_tqdm=False)  # warm-up (and the compile, cached)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n == batch * output_len, n
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backend", default="auto", help="structured outputs backend (auto, llguidance, xgrammar)")
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=512, structured_outputs_backend=args.backend)
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        best = {c: max(run(llm, b, args.output_len, c) for _ in range(args.repeats)) for c in (False, True)}
        rows.append({"batch": b, "tok_s_plain": round(best[False], 1), "tok_s_json_schema": round(best[True], 1),
                     "overhead_pct": round(100 * (1 - best[True] / best[False]), 1)})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
