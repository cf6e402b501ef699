"""KV transfer on this machine, pull and push: what moving a prompt's KV over NIXL costs next to computing it.

Engines in one process (a producer, a pull and/or a push consumer with the NixlConnector, and a plain one), fed the
same prompt lengths, interleaved rep by rep:
- ``local``: the plain engine computes the prompt and samples one token (what a decode instance does without
  disaggregation);
- ``pull`` (send_type GET): the consumer reads the producer's held blocks with NIXL READ (UCX, host memory) and
  computes only the last prompt token; its time covers admission, handshake (cached after the first), the read
  and the step;
- ``push`` (send_type PUT): the consumer registers its blocks with the producer over the side channel, the producer
  NIXL-WRITEs them and notifies, the consumer computes the last token.
The producer's engine loop runs on a thread throughout (as its server would: push needs it to act). Reports per
length the median and spread of each, the bytes moved, the transfer time alone (the consumer's connector counters:
for push, registration to completion notification) and push/pull ratios from the same interleaved run. The
producer's own prefill is in neither (it runs on another instance).

    python scripts/bench_kv_transfer.py --model .bench/llama-200m --lengths 128 512 1024 --reps 5 --mode both
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--mode", choices=["pull", "push", "both"], default="both",
                    help="pull (send_type GET), push (send_type PUT), or both interleaved with push/pull ratios")
    ap.add_argument("--out", help="write the figures as JSON here too")
    args = ap.parse_args(argv)

    from openinfer.entrypoints.llm import LLM
    from openinfer.sampling_params import SamplingParams

    max_len = max(args.lengths) + 8
    kw = dict(dtype=args.dtype, max_model_len=max_len, kv_cache_memory_gb=1.0, enable_prefix_caching=False)

    def pd(role, send_type="GET"):
        return LLM(args.model, kv_transfer_config=json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                                               "kv_connector_extra_config": {"send_type": send_type}}),
                   **kw)

    modes = ["pull", "push"] if args.mode == "both" else [args.mode]
    prod, plain = pd("kv_producer"), LLM(args.model, **kw)
    consumers = {m: pd("kv_consumer", "PUT" if m == "push" else "GET") for m in modes}
    vocab = plain.engine.config.model.vocab_size
    stop = threading.Event()

    lock = threading.Lock()  # the producer's own prefill (run from here) and its loop must not step at once

    def run(llm, ids, params=None):
        return llm.generate([{"prompt_token_ids": ids}],
                            SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, kv_transfer_params=params),
                            use_tqdm=False)[0]

    def held(ids):
        with lock:
            return run(prod, ids, {"do_remote_decode": True}).kv_transfer_params

    def producer_loop():  # the producer's server loop: it takes push registrations and frees read prompts
        while not stop.is_set():
            with lock:
                busy = prod.engine.has_unfinished_requests()
                if busy:
                    prod.engine.step()
            if not busy:
                time.sleep(0.0005)

    # warm-up: kernels, the first handshake / agent exchange
    warm = [7 + i % (vocab - 7) for i in range(16)]
    loop = threading.Thread(target=producer_loop, daemon=True)
    loop.start()
    for cons in consumers.values():
        run(cons, warm, held(warm))
    run(plain, warm)

    def stats(xs):
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    rows = []
    for n in args.lengths:
        local = []
        total = {m: [] for m in modes}
        xfer = {m: [] for m in modes}
        nbytes = {m: 0 for m in modes}
        for rep in range(args.reps):
            ids = [7 + (rep * 131 + i * 17) % (vocab - 7) for i in range(n)]
            t0 = time.perf_counter()
            run(plain, ids)
            local.append(time.perf_counter() - t0)
            for m in (modes if rep % 2 == 0 else modes[::-1]):  # alternate which mode goes first
                cons = consumers[m]
                params = held(ids)
                before = cons.engine.stats().kv_transfer
                t0 = time.perf_counter()
                out = run(cons, ids, params)
                total[m].append(time.perf_counter() - t0)
                after = cons.engine.stats().kv_transfer
                assert after.loads_ok == before.loads_ok + 1 and out.num_cached_tokens == n - 1, f"{m} fell back"
                xfer[m].append(after.seconds_receiving - before.seconds_receiving)
                nbytes[m] = after.bytes_received - before.bytes_received
        row = {"prompt_tokens": n, "local_prefill_s": stats(local)}
        line = f"{n:6d} tokens | local prefill {row['local_prefill_s']['median']:.3f} s"
        for m in modes:
            row[m] = {"bytes": nbytes[m], "total_s": stats(total[m]), "transfer_s": stats(xfer[m]),
                      "gib_per_s": nbytes[m] / statistics.median(xfer[m]) / (1 << 30)}
            line += (f" | {m} {nbytes[m] / (1 << 20):.2f} MiB total {row[m]['total_s']['median']:.3f} s "
                     f"[{row[m]['total_s']['min']:.3f}-{row[m]['total_s']['max']:.3f}] transfer "
                     f"{row[m]['transfer_s']['median'] * 1e3:.1f} ms [{row[m]['transfer_s']['min'] * 1e3:.1f}-"
                     f"{row[m]['transfer_s']['max'] * 1e3:.1f}]")
        if len(modes) == 2:
            row["push_over_pull"] = {
                "total": statistics.median(total["push"]) / statistics.median(total["pull"]),
                "transfer": statistics.median(xfer["push"]) / statistics.median(xfer["pull"]),
                "bytes": nbytes["push"] / nbytes["pull"]}
            r = row["push_over_pull"]
            line += f" | push/pull total {r['total']:.2f}x transfer {r['transfer']:.2f}x bytes {r['bytes']:.2f}x"
        rows.append(row)
        print(line, flush=True)
    stop.set()
    loop.join(30)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "reps": args.reps, "mode": args.mode, "rows": rows}, indent=2))
    for llm in (prod, plain, *consumers.values()):
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
