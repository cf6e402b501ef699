#!/usr/bin/env python
"""Acceptance per draft position of a speculative method on real text: prompts cut from Python's standard-library
sources in subpackages (json/, email/, ...), which scripts/train_tiny_mtp.py never trains on (it reads only the
top-level modules). Greedy by default, so the figures are the drafter's agreement with the target;
``--temperature`` samples (seeded per prompt), ``--confidence-token-cost`` turns on DSpark's confidence-scheduled
verification (engine/confidence_schedule.py).

    python scripts/spec_acceptance.py --model .bench/dsv3-mtp-tiny --method mtp --k 1,2,3 --out acc.json
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def prompts(n: int, length: int) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for pkg in ("json", "email", "http", "urllib", "logging") for f in (stdlib / pkg).glob("*.py"))
    text = "".join(c for f in files for c in f.read_text(errors="ignore") if c.isascii() and c.isprintable()
                   or c == "\n")
    step = max(1, (len(text) - length) // n)
    return [text[i * step:i * step + length] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--method", default="mtp")
    ap.add_argument("--k", default="1,2,3")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-chars", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--confidence-token-cost", type=float, default=None,
                    help="speculative_config.confidence_token_cost (DSpark: the confidence head picks the drafts)")
    ap.add_argument("--check-identity", action="store_true",
                    help="also generate without drafting and count the prompts whose greedy tokens are identical")
    args = ap.parse_args()

    from openinfer import LLM, SamplingParams

    ps = prompts(args.num_prompts, args.prompt_chars)
    sps = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                          seed=i if args.temperature > 0 else None) for i in range(len(ps))]
    rows = []
    plain = None
    if args.check_identity:
        llm = LLM(args.model, dtype="float32")
        plain = [o.outputs[0].token_ids for o in llm.generate(ps, sps, use_tqdm=False)]
        del llm
    for k in (int(x) for x in args.k.split(",")):
        spec = {"method": args.method, "num_speculative_tokens": k}
        if args.confidence_token_cost is not None:
            spec["confidence_token_cost"] = args.confidence_token_cost
        llm = LLM(args.model, dtype="float32", speculative_config=spec)
        outs = llm.generate(ps, sps, use_tqdm=False)
        s = llm.engine.stats().spec_decode
        per_pos = [a / s.num_drafts for a in s.accepted_per_pos]
        # each target step of a request emits 1 + its accepted drafts: steps = emitted - accepted
        emitted = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = emitted - s.num_accepted_tokens
        rows.append({"k": k, "num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                     "num_accepted_tokens": s.num_accepted_tokens, "acceptance_per_position": per_pos,
                     "acceptance_rate": s.num_accepted_tokens / s.num_draft_tokens,
                     "mean_accepted_length": s.mean_accepted_length,
                     "tokens_per_step": emitted / steps, "verified_drafts_per_step": s.num_draft_tokens / steps})
        same = ""
        if plain is not None:
            n_same = sum(list(o.outputs[0].token_ids) == list(p) for o, p in zip(outs, plain))
            rows[-1]["greedy_identical"] = f"{n_same}/{len(ps)}"
            same = f"; greedy identical to no drafting {n_same}/{len(ps)}"
        print(f"k={k}: acceptance per position {', '.join(f'{p:.1%}' for p in per_pos)}; "
              f"acceptance rate {rows[-1]['acceptance_rate']:.1%}; mean accepted length "
              f"{s.mean_accepted_length:.2f}; tokens / step {emitted / steps:.2f} with "
              f"{s.num_draft_tokens / steps:.2f} drafts verified / step{same}", flush=True)
        del llm
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "method": args.method, "prompts":
                                              f"{args.num_prompts} x {args.prompt_chars} chars of stdlib subpackages",
                                              "max_tokens": args.max_tokens, "temperature": args.temperature,
                                              "confidence_token_cost": args.confidence_token_cost,
                                              "results": rows}, indent=2))


if __name__ == "__main__":
    main()
