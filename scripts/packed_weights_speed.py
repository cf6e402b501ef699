"""DeepSeek weights kept as shipped vs dequantised at load (issue 16): V4's MXFP4 routed experts (``--format
mxfp4``, must-show 4) or V3 / V4's FP8 block-quantised linears and experts (``--format fp8``). Resident bytes and
decode tokens/s on the same checkpoint, the two modes interleaved in one process (the box is shared, so only
ratios measured side by side mean much).

- Resident bytes: the engine's weight bytes (``layers.linear.weight_bytes``: parameters, prepacked and packed
  weights) and the routed experts' share of them, and the process RSS after loading and one decode window,
  each mode in a fresh subprocess of its own (RSS is per process).
- Decode tok/s: one engine per mode loaded up front (``OPENINFER_MXFP4_EXPERTS`` / ``OPENINFER_FP8_WEIGHTS`` is
  read when the model is built); for each round and batch size every mode runs one timed decode window
  (``bench/decode_window.py``: prefill untimed, then exactly ``--steps`` pure decode steps), in rotating order. Reported per mode and batch:
  the median over the rounds with its min-max and the ratio to the dequantised median.

    python scripts/make_deepseek_v4_checkpoint.py --size bench --quantize release-fp4 --out /work/bench/v4-bench-fp4
    python scripts/packed_weights_speed.py --model /work/bench/v4-bench-fp4 --dtype bfloat16 --batches 1 8 32 --rounds 3
    python scripts/packed_weights_speed.py --format fp8 --model /work/bench/dsv3-65m-fp8 --dtype float32
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout: this checkout's openinfer, not an installed one
    sys.path.insert(0, str(ROOT))

MODES = ("dequantize", "packed")
SWITCH = {"mxfp4": "OPENINFER_MXFP4_EXPERTS", "fp8": "OPENINFER_FP8_WEIGHTS"}  # --format -> its mode variable


def _engine(model: str, fmt: str, mode: str, dtype: str, batches: list[int], context_len: int, steps: int):
    from openinfer import LLM

    os.environ[SWITCH[fmt]] = mode
    max_len = context_len + steps * 4 + 64
    return LLM(model=model, dtype=dtype, max_num_seqs=max(batches), max_model_len=max_len,
               num_kv_blocks=max(batches) * (-(-max_len // 16)) + 8)


def _bytes(llm) -> dict[str, int]:
    from openinfer.layers.deepseek_moe import DeepseekExperts
    from openinfer.layers.linear import weight_bytes
    from openinfer.layers.quant_linear import QuantizedWeight

    model = llm.engine.core.executor.driver_worker.model
    experts = 0
    for m in model.modules():
        if isinstance(m, DeepseekExperts):
            ws = ([w for group in m._packed for w in group] if m._packed is not None
                  else list(m._panels or (m.w13_weight, m.w2_weight)))
            experts += sum(w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size() for w in ws)
    return {"weight_bytes": weight_bytes(model), "expert_bytes": experts}


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def rss_child(args) -> None:
    """``--rss-of MODE``: load one engine, run one decode window at the largest batch, print bytes as JSON."""
    from openinfer.bench.decode_window import run_decode_window

    import torch

    torch.set_num_threads(args.threads)
    llm = _engine(args.model, args.format, args.rss_of, args.dtype, args.batches, args.context_len, args.steps)
    import openinfer

    out = {"mode": args.rss_of, **_bytes(llm), "rss_after_load": _rss_bytes(), "openinfer": openinfer.__file__}
    rng = random.Random(0)
    vocab = llm.engine.config.model.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.context_len)] for _ in range(max(args.batches))]
    run_decode_window(llm.engine, prompts, args.steps, 0.0)
    out["rss_after_decode"] = _rss_bytes()
    print("RSS_JSON " + json.dumps(out), flush=True)
    llm.engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--format", choices=sorted(SWITCH), default="mxfp4", help="which shipped format to A/B")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--context-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the box is shared)")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--rss-of", choices=MODES, default=None, help=argparse.SUPPRESS)  # the per-mode child
    args = ap.parse_args()
    if args.rss_of:
        return rss_child(args)

    resident = {}
    for mode in MODES:  # each in a fresh process: RSS is per process
        cmd = [sys.executable, __file__, "--rss-of", mode] + sys.argv[1:]
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RSS_JSON "))
        resident[mode] = json.loads(line.removeprefix("RSS_JSON "))
        print(f"{mode}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in resident[mode].items()
                                      if isinstance(v, int)) + f" ({resident[mode]['openinfer']})", flush=True)

    import torch

    from openinfer.bench.decode_window import run_decode_window

    torch.set_num_threads(args.threads)
    engines = {mode: _engine(args.model, args.format, mode, args.dtype, args.batches, args.context_len,
                             args.steps).engine
               for mode in MODES}
    rng = random.Random(0)
    vocab = engines[MODES[0]].config.model.vocab_size
    samples: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for b in args.batches:
            prompts = [[rng.randrange(3, vocab) for _ in range(args.context_len)] for _ in range(b)]
            order = MODES[r % 2:] + MODES[:r % 2]
            for mode in order:
                s = run_decode_window(engines[mode], prompts, args.steps, 0.0).sample
                samples.setdefault((mode, b), []).append(s.num_output_tokens / s.elapsed_s)
            print(f"round {r} batch {b}: " + ", ".join(f"{m} {samples[(m, b)][-1]:.1f}" for m in MODES), flush=True)
    rows = []
    print(f"\n{'mode':10} {'batch':>5} {'tok/s median':>12} {'min-max':>15} {'x dequant':>9}")
    for b in args.batches:
        base = statistics.median(samples[(MODES[0], b)])
        for mode in MODES:
            xs = samples[(mode, b)]
            med = statistics.median(xs)
            rows.append({"mode": mode, "batch": b, "tok_s": xs, "median": med, "ratio": med / base})
            print(f"{mode:10} {b:5d} {med:12.1f} {min(xs):7.1f}-{max(xs):<7.1f} {med / base:9.2f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "resident": resident, "rows": rows,
                       "loadavg": os.getloadavg()}, f, indent=1)
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    main()
