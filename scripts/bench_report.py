"""Regenerate the committed example report: openinfer vs HF transformers on the benchmark checkpoint.

One command (from the repository root, on a quiet machine: the numbers are only as good as the host is idle)::

    .venv/bin/python scripts/bench_report.py

writes ``benchmarks/report/`` (end-to-end: ``peers.json``, ``throughput.png``, ``README.md``) and
``benchmarks/report/decode/`` (steady-state decode at context 512, same three files), creating the 246M
Llama checkpoint at ``.bench/llama-200m`` first if it is missing. The dtype defaults to bf16 where the CPU has
native bf16 (AMX / AVX512-BF16) and fp32 elsewhere, because emulated bf16 would measure the emulation. The
workload is issue 2's (prompt 128, output 128, batch 1-256); the defaults are sized so the whole run takes about 25 minutes
on a 2-core host; ``--no-decode`` skips the decode curve.

A smoke run on a tiny checkpoint (seconds)::

    .venv/bin/python scripts/bench_report.py --model /tmp/tiny --out /tmp/report --batch-sizes 1,2 \\
        --input-len 16 --output-len 8 --decode-batch-sizes 1,2 --context-len 32 --decode-steps 8
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=".bench/llama-200m",
                    help="checkpoint (made by make_bench_checkpoint.py if this default path is missing)")
    ap.add_argument("--out", default="benchmarks/report", help="report folder")
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads for every engine")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CPUs with native bf16, else float32")
    ap.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-iters", type=int, default=2, help="fresh processes per engine and point")
    ap.add_argument("--no-decode", dest="decode", action="store_false", help="skip the decode-mode curve")
    ap.add_argument("--decode-batch-sizes", default="1,8,32,64")
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=32)
    args = ap.parse_args()

    if args.dtype is None:
        sys.path.insert(0, str(REPO))
        from openinfer.platform import cpu_has_fast_bf16

        args.dtype = "bfloat16" if cpu_has_fast_bf16() else "float32"
    model, out = Path(args.model), Path(args.out)
    if not model.exists():
        if args.model != ap.get_default("model"):
            ap.error(f"--model {args.model} does not exist")
        run([sys.executable, "scripts/make_bench_checkpoint.py", "--out", str(model)], args.threads)
    largest = max(int(b) for b in (args.batch_sizes + "," + args.decode_batch_sizes).split(",") if b.strip())
    common = ["--model", str(model), "--peers", "hf", "--dtype", args.dtype, "--hf-max-batch", str(largest),
              "--num-threads", str(args.threads), "--num-iters", str(args.num_iters)]
    peers = [sys.executable, "-m", "openinfer", "bench", "peers"]
    t0 = time.perf_counter()
    run(peers + common + ["--batch-sizes", args.batch_sizes, "--input-len", str(args.input_len),
                          "--output-len", str(args.output_len), "--output-dir", str(out)], args.threads)
    if args.decode:
        run(peers + common + ["--mode", "decode", "--batch-sizes", args.decode_batch_sizes, "--context-len",
                              str(args.context_len), "--decode-steps", str(args.decode_steps),
                              "--output-dir", str(out / "decode")], args.threads)
    how = "Regenerate with `" + shlex.join(["python", "scripts/bench_report.py", *sys.argv[1:]]) + "`"
    note(out / "README.md", how + (" (it also writes [decode/](decode/README.md): steady-state decode)."
                                   if args.decode else "."))
    if args.decode:
        note(out / "decode" / "README.md",
             how + " (it also writes the end-to-end report, [../](../README.md)).")
    print(f"report written to {out} in {(time.perf_counter() - t0) / 60:.1f} min")
    return 0


def run(cmd: list[str], threads: int) -> None:
    # OpenMP's pool matches torch's thread count in every engine; PYTHONPATH lets the children import this
    # checkout without an install.
    env = dict(os.environ, OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    print("+ " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, env=env, check=True)


def note(readme: Path, line: str) -> None:
    """Put how to regenerate the report under its title."""
    title, _, rest = readme.read_text().partition("\n")
    readme.write_text(f"{title}\n\n{line}\n{rest}")


if __name__ == "__main__":
    raise SystemExit(main())
