#!/usr/bin/env bash
# Cache-aware vs round-robin through vllm-router 0.1.17 on the agentic replay (issue 12, must-show 3).
# Two fresh openinfer workers per run (started by `openinfer router`), same synthetic trace and salt for every run,
# policies interleaved over two rounds. 2-core AVX2 box shared with other jobs: compare within this file only.
set -euo pipefail
cd "$(dirname "$0")/../../.."
python scripts/make_bench_checkpoint.py --help >/dev/null  # the model: a random-weight 49.7M Llama (below)
[ -d .bench/llama-30m ] || PYTHONPATH=scripts python -c "
from pathlib import Path; from make_bench_checkpoint import make_checkpoint
make_checkpoint(Path('.bench/llama-30m'), 0, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=1408, max_position_embeddings=4096)"
python scripts/bench_router_policies.py --model .bench/llama-30m --workers 2 \
  --worker-args "--dtype float32 --max-model-len 4096 --num-kv-blocks 512" \
  --policies round_robin cache_aware --rounds 2 --out benchmarks/results/router-policies/policies.json -- \
  --synthetic-sessions 8 --synthetic-turns 3 --concurrency 4 --seed 0 --salt router-policies --no-think-time
# Round 0 ran as above (--rounds 2) and its two runs are in round0.jsonl (round 1 of that invocation never started:
# its workers hung on a stale kernel-cache lock). Round 1, policies in
# the other order, into policies.json:
python scripts/bench_router_policies.py --model .bench/llama-30m --workers 2 \
  --worker-args "--dtype float32 --max-model-len 4096 --num-kv-blocks 512" \
  --policies cache_aware round_robin --rounds 1 --first-round 1 --out benchmarks/results/router-policies/policies.json -- \
  --synthetic-sessions 8 --synthetic-turns 3 --concurrency 4 --seed 0 --salt router-policies --no-think-time
# summary.json = round0.jsonl + policies.json runs side by side (merged by hand with a few lines of Python).
