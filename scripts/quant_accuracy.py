"""Accuracy of ``--quantization int8 / int4 / w8a8 / w4a8``, and of low-bit checkpoints made from the same weights
(``scripts/make_quantized_checkpoint.py``: compressed-tensors W8A8 / W4A16, GPTQ), against the unquantised weights
(issue 16, must-show 2).

Per mode, on a fixed English text (teacher-forced, ``prompt_logprobs``): mean logprob of the text's tokens and
its perplexity, the mean |logprob difference| per token vs the unquantised model, and how often the top-1 next
token agrees with the unquantised model's; then greedy generation from fixed prompts: the fraction of generated
tokens equal to the unquantised run's (position by position) and the mean length of the common prefix.

The embedded default model (trained, ~4M params) gives a meaningful perplexity; the random-weight bench
checkpoint (``scripts/make_bench_checkpoint.py``) only the agreement figures.

    python scripts/quant_accuracy.py                         # the default model
    python scripts/quant_accuracy.py --model .bench/llama-200m
    python scripts/quant_accuracy.py --modes int8 w8a8 --checkpoint ct-w8a8=/tmp/dm-w8a8 --checkpoint gptq=/tmp/dm-gptq
"""
from __future__ import annotations

import argparse
import json
import math

TEXT = ("The interpreter reads a line of input, parses it into a sequence of statements and executes them. "
        "When a function is called, a new frame is created for its local variables; the frame is discarded "
        "when the function returns. A class definition creates a new namespace, and the names assigned in its "
        "body become attributes of the class object. Exceptions are raised when an error occurs, and they can "
        "be handled with a try statement whose except clauses name the exception types they accept. Modules "
        "are imported once; later imports of the same module return the object stored in sys.modules.")
PROMPTS = ["The value of a variable", "A module is", "When the loop ends,", "def main():\n    "]


def run(model: str | None, quant: str | None, gen_tokens: int, max_text_tokens: int) -> dict:
    from openinfer import LLM, SamplingParams

    llm = LLM(model=model, quantization=quant, num_kv_blocks=256)
    tok = llm.get_tokenizer()
    ids = tok.encode(TEXT)[:max_text_tokens]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    lps, top1 = [], []
    for t, d in zip(ids[1:], out.prompt_logprobs[1:]):
        lps.append(float(d[t]))  # the text's token, plus the top-1 entry
        top1.append(int(max(d.items(), key=lambda kv: kv[1])[0]))
    greedy = llm.generate([{"prompt_token_ids": tok.encode(p)} for p in PROMPTS],
                          SamplingParams(temperature=0, max_tokens=gen_tokens, ignore_eos=True))
    llm.engine.shutdown()
    return {"logprobs": lps, "top1": top1, "greedy": [list(o.outputs[0].token_ids) for o in greedy]}


def compare(base: dict, other: dict) -> dict:
    n = len(base["logprobs"])
    prefix = []
    for a, b in zip(base["greedy"], other["greedy"]):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(k)
    same = sum(x == y for a, b in zip(base["greedy"], other["greedy"]) for x, y in zip(a, b))
    total = sum(len(a) for a in base["greedy"])
    mean_lp = sum(other["logprobs"]) / n
    return {"mean_logprob": mean_lp, "perplexity": math.exp(-mean_lp),
            "mean_abs_dlogprob": sum(abs(a - b) for a, b in zip(base["logprobs"], other["logprobs"])) / n,
            "top1_agreement": sum(a == b for a, b in zip(base["top1"], other["top1"])) / n,
            "greedy_token_agreement": same / total, "greedy_common_prefix": sum(prefix) / len(prefix),
            "text_tokens": n + 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--max-text-tokens", type=int, default=512)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--modes", nargs="*", default=["int8", "int4"], help="--quantization methods, at load")
    ap.add_argument("--checkpoint", action="append", default=[],
                    help="NAME=PATH: also a low-bit checkpoint made from --model's weights (repeatable)")
    args = ap.parse_args()
    runs = {"none": run(args.model, None, args.gen_tokens, args.max_text_tokens)}
    for q in args.modes:
        runs[q] = run(args.model, q, args.gen_tokens, args.max_text_tokens)
    for spec in args.checkpoint:  # NAME=PATH: a low-bit checkpoint of the same source weights
        name, _, path = spec.partition("=")
        if not path:
            ap.error(f"--checkpoint wants NAME=PATH, got {spec!r}")
        runs[name] = run(path, None, args.gen_tokens, args.max_text_tokens)
    rows = {q: compare(runs["none"], r) for q, r in runs.items()}
    print(f"model: {args.model or 'default'}")
    print(f"{'mode':9} {'mean logprob':>12} {'ppl':>9} {'|dlogprob|':>10} {'top1 agree':>10} "
          f"{'greedy agree':>12} {'common prefix':>13}")
    for q, r in rows.items():
        print(f"{q:9} {r['mean_logprob']:12.4f} {r['perplexity']:9.3f} {r['mean_abs_dlogprob']:10.4f} "
              f"{r['top1_agreement']:10.3f} {r['greedy_token_agreement']:12.3f} "
              f"{r['greedy_common_prefix']:10.1f}/{args.gen_tokens}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
