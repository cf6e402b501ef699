"""Time to first token of a prompt whose prefix was evicted from a too-small pool: recomputed (no tier) vs loaded
from the disk tier (--kv-offloading-size). A random dense checkpoint of the given shape is written to a temporary
folder; the figure is the median of ``--repeats`` rounds of: the prompt, enough other prompts to evict it, the
prompt again (timed, max_tokens=1).

    python scripts/kv_tier_reload.py --prompt-len 1024 --hidden 512 --layers 8
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from helpers import make_dense_checkpoint, random_prompts

    from openinfer.entrypoints.llm import LLM
    from openinfer.sampling_params import SamplingParams

    tmp = Path(tempfile.mkdtemp(prefix="kv-tier-bench-"))
    heads = max(1, args.hidden // 64)
    ck = make_dense_checkpoint(tmp / "ck", hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                               num_hidden_layers=args.layers, num_attention_heads=heads,
                               num_key_value_heads=max(1, heads // 4), max_position_embeddings=4 * args.prompt_len)
    n = args.prompt_len
    bs = 16
    blocks = 2 * (n // bs) + 8  # room for one prompt and a bit: the next one evicts the first
    kw = dict(dtype="float32", max_model_len=2 * n, num_kv_blocks=blocks, block_size=bs)
    sp = SamplingParams(temperature=0, max_tokens=1)
    results = {}
    for name, extra in (("no tier (recompute)", {}),
                        ("disk tier (load)", dict(kv_offloading_size=1.0, kv_offloading_path=str(tmp / "tier")))):
        llm = LLM(str(ck), **kw, **extra)
        times, cached = [], []
        for r in range(args.repeats):
            a, *others = random_prompts(100 + r, [n, n, n])
            llm.generate([a], sp, use_tqdm=False)
            for p in others:
                llm.generate([p], sp, use_tqdm=False)
            core = llm.engine.core
            while core.has_unfinished_requests():  # let the tier's writes finish (they overlap serving otherwise)
                core.step()
            t0 = time.perf_counter()
            out = llm.generate([a], sp, use_tqdm=False)[0]
            times.append(time.perf_counter() - t0)
            cached.append(out.num_cached_tokens)
        results[name] = (statistics.median(times), cached)
        llm.engine.core.shutdown()
    print(f"dense {args.layers} layers x {args.hidden} hidden, fp32, {n}-token prompt, pool {blocks} blocks of {bs}")
    for name, (t, cached) in results.items():
        print(f"  {name:22s} TTFT median {t * 1000:8.1f} ms   cached tokens {cached}")


if __name__ == "__main__":
    main()
