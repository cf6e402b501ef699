#!/usr/bin/env bash
# DeepSeek-V4.1-shaped vs V4-Flash-shaped bench checkpoints (~200M params each, random weights, fp32 tensors),
# openinfer bench throughput, fp32, one torch thread, input 16 / output 16, batch 1-256, runs interleaved
# (V4, V4.1, V4, V4.1) so drift on the shared host shows. KV bytes per token from scripts/kv_bytes_report.py
# (the figures the engine logs at start-up). Run from the repository root.
set -euo pipefail
OUT=benchmarks/results/v41-vs-v4-bench
[ -d .bench/v4-bench-fp32 ] || python scripts/make_deepseek_v4_checkpoint.py --size bench --dtype float32 --out .bench/v4-bench-fp32
[ -d .bench/v41-bench-fp32 ] || python scripts/make_deepseek_v41_checkpoint.py --size bench --no-quantize --out .bench/v41-bench-fp32
python scripts/kv_bytes_report.py --dtype float32 .bench/v4-bench-fp32/config.json .bench/v41-bench-fp32/config.json \
  | tee "$OUT/kv_bytes.txt"
for run in 1 2; do
  for m in v4 v41; do
    openinfer bench throughput --model ".bench/${m}-bench-fp32" --dtype float32 --num-threads 1 \
      --batch-sizes 1,4,16,64,256 --input-len 16 --output-len 16 --num-iters 1 --warmup-iters 0 \
      --max-model-len 64 --output-json "$OUT/${m}-run${run}.json"
  done
done
python "$OUT/summarize.py" "$OUT" | tee "$OUT/summary.md"
