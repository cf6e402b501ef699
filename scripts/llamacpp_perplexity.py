"""llama.cpp's perplexity of a GGUF file on tests/data/factbook_backgrounds.txt, by gguf_accuracy.py's protocol
(chunks of 512 tokens, each chunk's second half scored given what precedes it), optionally on the first N chunks
only. Run with the llama-cpp-python venv:

    python scripts/llamacpp_perplexity.py FILE.gguf OUT.json [N_CHUNKS]
"""
import json
import math
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

CTX = 512


def main() -> None:
    path, out = sys.argv[1], sys.argv[2]
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else None
    llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_batch=CTX, n_ubatch=CTX, n_threads=1, logits_all=True,
                          verbose=False)
    text = (Path(__file__).resolve().parent.parent / "tests" / "data" / "factbook_backgrounds.txt").read_text()
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)
    chunks = [ids[i:i + CTX] for i in range(0, len(ids) - CTX + 1, CTX)][:limit]
    nll, n, t0 = 0.0, 0, time.time()
    for chunk in chunks:
        llm.reset()
        llm.eval(chunk)
        logits = np.asarray(llm.scores[:len(chunk)], dtype=np.float64)
        for i in range(len(chunk) // 2, len(chunk)):
            row = logits[i - 1]
            m = row.max()
            nll -= row[chunk[i]] - m - math.log(np.exp(row - m).sum())
            n += 1
    res = {"gguf": path, "chunks": len(chunks), "scored": n, "perplexity": math.exp(nll / n),
           "llama_cpp_python": llama_cpp.__version__, "seconds": time.time() - t0, "command": " ".join(sys.argv)}
    Path(out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
