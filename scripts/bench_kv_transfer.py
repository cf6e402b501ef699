"""Pull-mode KV transfer on this machine: what moving a prompt's KV over NIXL costs next to computing it.

Three engines in one process (a producer and a consumer with the NixlConnector, and a plain one), fed the same
prompt lengths, interleaved rep by rep:
- ``local``: the plain engine computes the prompt and samples one token (what a decode instance does without
  disaggregation);
- ``pull``: the consumer reads the producer's held blocks with NIXL READ (UCX, host memory) and computes only the
  last prompt token; its time covers admission, handshake (cached after the first), the read and the step.
Reports per length the median and spread of both, the bytes read and the NIXL read time alone (from the
connector's counters). The producer's own prefill is not in ``pull`` (it runs on another instance).

    python scripts/bench_kv_transfer.py --model .bench/llama-200m --lengths 128 512 1024 --reps 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", help="write the figures as JSON here too")
    args = ap.parse_args(argv)

    from openinfer.entrypoints.llm import LLM
    from openinfer.sampling_params import SamplingParams

    max_len = max(args.lengths) + 8
    kw = dict(dtype=args.dtype, max_model_len=max_len, kv_cache_memory_gb=1.0, enable_prefix_caching=False)

    def pd(role):
        return LLM(args.model, kv_transfer_config=json.dumps({"kv_connector": "NixlConnector", "kv_role": role}),
                   **kw)

    prod, cons, plain = pd("kv_producer"), pd("kv_consumer"), LLM(args.model, **kw)
    vocab = plain.engine.config.model.vocab_size

    def run(llm, ids, params=None):
        return llm.generate([{"prompt_token_ids": ids}],
                            SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, kv_transfer_params=params),
                            use_tqdm=False)[0]

    # warm-up: kernels, the first handshake
    warm = [7 + i % (vocab - 7) for i in range(16)]
    run(cons, warm, run(prod, warm, {"do_remote_decode": True}).kv_transfer_params)
    run(plain, warm)
    rows = []
    for n in args.lengths:
        local, pull, xfer, nbytes = [], [], [], 0
        for rep in range(args.reps):
            ids = [7 + (rep * 131 + i * 17) % (vocab - 7) for i in range(n)]
            t0 = time.perf_counter()
            run(plain, ids)
            local.append(time.perf_counter() - t0)
            params = run(prod, ids, {"do_remote_decode": True}).kv_transfer_params
            before = cons.engine.stats().kv_transfer
            t0 = time.perf_counter()
            out = run(cons, ids, params)
            pull.append(time.perf_counter() - t0)
            after = cons.engine.stats().kv_transfer
            assert after.loads_ok == before.loads_ok + 1 and out.num_cached_tokens == n - 1, "the read fell back"
            xfer.append(after.seconds_receiving - before.seconds_receiving)
            nbytes = after.bytes_received - before.bytes_received
        row = {"prompt_tokens": n, "bytes": nbytes,
               "local_prefill_s": {"median": statistics.median(local), "min": min(local), "max": max(local)},
               "pull_s": {"median": statistics.median(pull), "min": min(pull), "max": max(pull)},
               "nixl_read_s": {"median": statistics.median(xfer), "min": min(xfer), "max": max(xfer)},
               "read_gib_per_s": nbytes / statistics.median(xfer) / (1 << 30)}
        rows.append(row)
        print(f"{n:6d} tokens {nbytes / (1 << 20):8.2f} MiB | local prefill {row['local_prefill_s']['median']:.3f} s "
              f"[{row['local_prefill_s']['min']:.3f}-{row['local_prefill_s']['max']:.3f}] | pull "
              f"{row['pull_s']['median']:.3f} s [{row['pull_s']['min']:.3f}-{row['pull_s']['max']:.3f}] "
              f"(NIXL read {row['nixl_read_s']['median'] * 1e3:.1f} ms, {row['read_gib_per_s']:.2f} GiB/s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "reps": args.reps, "rows": rows}, indent=2))
    for llm in (prod, cons, plain):
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
