#!/usr/bin/env bash
# YOCO shortened prefill on the V4.1-shaped bench checkpoint (window 128, 3 consumer layers of 8): one 1024-token
# prompt, 1 output token, fp32, one thread, prefix caching off (the shortcut's condition), with the shortcut off
# (OPENINFER_SKIP_UNREAD_ROWS=0) and on, interleaved (off, on, off, on). Run from the repository root after
# benchmarks/results/v41-vs-v4-bench/run.sh made .bench/v41-bench-fp32.
set -euo pipefail
OUT=benchmarks/results/v41-yoco-prefill
for run in 1 2; do
  for skip in 0 1; do
    OPENINFER_SKIP_UNREAD_ROWS=$skip openinfer bench throughput --model .bench/v41-bench-fp32 --dtype float32 \
      --num-threads 1 --batch-sizes 1 --input-len 1024 --output-len 1 --num-iters 1 --warmup-iters 0 \
      --max-model-len 1100 --no-enable-prefix-caching --output-json "$OUT/skip${skip}-run${run}.json"
  done
done
