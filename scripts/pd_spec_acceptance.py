#!/usr/bin/env python
"""MTP acceptance on the decode side of prefill/decode disaggregation vs one process, on a trained MTP layer (random
weights accept nothing): the prompts' KV - the MTP layer's included - comes over NIXL, and the decoder should make
and accept the same drafts as one process. Two in-process instances over real NIXL on host memory.

    python scripts/train_tiny_mtp.py --out /tmp/comp_mtp/model --steps 400
    python scripts/pd_spec_acceptance.py --model /tmp/comp_mtp/model --layout one --send-type GET
    GLOO_SOCKET_IFNAME=lo python scripts/pd_spec_acceptance.py --model /tmp/comp_mtp/model --layout dp2ep \
        --send-type PUT --max-num-batched-tokens 1024
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

LAYOUTS = {"one": {}, "tp2": {"tensor_parallel_size": 2},
           "dp2ep": {"data_parallel_size": 2, "enable_expert_parallel": True}}


def _stats(llm) -> dict:
    s = llm.engine.stats().spec_decode
    return {"drafts": s.num_drafts, "draft_tokens": s.num_draft_tokens, "accepted": s.num_accepted_tokens,
            "accepted_per_position": list(s.accepted_per_pos)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="one", help="both instances' parallel layout")
    ap.add_argument("--send-type", choices=("GET", "PUT"), default="GET")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-chars", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16)
    args = ap.parse_args()

    from spec_acceptance import prompts

    from openinfer import LLM, SamplingParams

    spec = {"method": "mtp", "num_speculative_tokens": args.k}
    kw = dict(dtype="float32", kv_cache_memory_gb=0.05, max_num_batched_tokens=args.max_num_batched_tokens, speculative_config=spec)
    ps = prompts(args.num_prompts, args.prompt_chars)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    # One process, twice: as it comes (prompts staggered behind chunked prefill), and with the prompts' KV already
    # cached (all of them decoding together from their first step, as on the PD decoder: batch composition moves
    # fp32 rounding, which can flip a drafter's near-tied argmax).
    ref = LLM(args.model, **kw)
    want = [o.outputs[0].token_ids for o in ref.generate(ps, sp, use_tqdm=False)]
    one = _stats(ref)
    before = _stats(ref)
    assert [o.outputs[0].token_ids for o in ref.generate(ps, sp, use_tqdm=False)] == want
    after = _stats(ref)
    warm = {k: (after[k] - before[k] if k != "accepted_per_position" else
                [a - b for a, b in zip(after[k], before[k])]) for k in after}
    ref.engine.shutdown()

    def pd(role, **extra):
        kt = {"kv_connector": "NixlConnector", "kv_role": role, **extra}
        return LLM(args.model, kv_transfer_config=json.dumps(kt), **kw, **LAYOUTS[args.layout])

    prod = pd("kv_producer")
    cons = pd("kv_consumer", kv_connector_extra_config={"send_type": args.send_type})
    held = prod.generate(ps, [SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
                              for _ in ps], use_tqdm=False)
    stop = threading.Event()

    def producer_loop():  # the producer serves reads and pushes while the decoder runs, as its server would
        while not stop.is_set():
            if prod.engine.has_unfinished_requests():
                prod.engine.step()
            else:
                time.sleep(0.002)

    t = threading.Thread(target=producer_loop, daemon=True)
    t.start()
    outs = cons.generate(ps, [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                             kv_transfer_params=h.kv_transfer_params) for h in held], use_tqdm=False)
    stop.set()
    t.join(30)
    s = cons.engine.stats()
    print(json.dumps({
        "layout": args.layout, "send_type": args.send_type, "k": args.k, "prompts": len(ps),
        "tokens_identical": sum(o.outputs[0].token_ids == w for o, w in zip(outs, want)),
        "prompt_tokens_received": s.prompt_tokens_received, "prompt_tokens_computed": s.prompt_tokens_computed,
        "kv_loads": s.kv_transfer.loads_ok, "kv_fallbacks": s.kv_transfer.fallbacks,
        "kv_bytes": s.kv_transfer.bytes_received,
        "one_process": one, "one_process_prompts_cached": warm, "pd_decoder": _stats(cons)}, indent=1))
    for llm in (prod, cons):
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
