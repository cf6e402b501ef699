"""Perplexity of a GGUF file with openinfer's int8-activation GGUF kernel on every row (prefill included), against
llama.cpp's figure from scripts/gguf_accuracy.py's result on the same file and text.

The engine's prefill decodes weight chunks to fp32 for a GEMM from GGUF_DEQUANT_ROWS rows on, so
gguf_accuracy.py's perplexity (512-token chunks) measures the fp32 path; here that switch is moved past any step's
row count and ``--gguf-activations`` picks the kernel, so every linear runs int8 (or fp32) activations as decode
steps do -- the accuracy of the int8 path on the full text, the way llama.cpp's perplexity tool computes it.

    python scripts/gguf_q8_perplexity.py [--gguf FILE] [--activations int8] \\
        [--reference docs/results/gguf_accuracy_smollm2.json] [--chunks N]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--activations", choices=("int8", "fp32"), default="int8")
    ap.add_argument("--reference", default=str(ROOT / "docs" / "results" / "gguf_accuracy_smollm2.json"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=0, help="only the first N chunks (0: all)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    os.environ["OPENINFER_GGUF_ACTIVATIONS"] = args.activations  # read by KernelConfig.from_env via envs.py

    from gguf_accuracy import scored_nll  # the same perplexity protocol as the llama.cpp comparison
    from openinfer import LLM
    from openinfer.assets_path import smollm2_path
    from openinfer.layers import gguf_quant
    from openinfer.tokenizer import load_tokenizer

    gguf = args.gguf or smollm2_path()
    tok = load_tokenizer(gguf)
    ids = tok((ROOT / "tests" / "data" / "factbook_backgrounds.txt").read_text(), add_special_tokens=False).input_ids
    chunks = [ids[i:i + args.ctx] for i in range(0, len(ids) - args.ctx + 1, args.ctx)]
    if args.chunks:
        chunks = chunks[:args.chunks]
    # every step's rows through the int8 kernels: from GGUF_TILE_ROWS rows the prefill tile kernel (the engine's own
    # prefill path since it exists), below that and for the types it lacks the register-tile kernels
    gguf_quant.GGUF_DEQUANT_ROWS = 1 << 30
    llm = LLM(model=gguf, dtype="float32", max_model_len=1024, max_num_seqs=8)
    t0 = time.perf_counter()
    nll, n = scored_nll(llm, chunks)
    ppl = math.exp(nll / n)
    res = {"gguf": Path(gguf).name, "activations": args.activations, "chunks": len(chunks), "scored_tokens": n,
           "perplexity": ppl, "seconds": time.perf_counter() - t0, "command": " ".join(sys.argv)}
    ref = Path(args.reference)
    if ref.exists() and not args.chunks:
        p = json.loads(ref.read_text())["perplexity"]
        res.update(llamacpp=p["llamacpp"], openinfer_fp32_decoded_prefill=p["openinfer"],
                   relative_to_llamacpp=ppl / p["llamacpp"] - 1.0)
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
