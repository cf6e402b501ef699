#!/bin/bash
# interleaved A/B: before (main checkout, read-only) vs after (this branch), one process each, 1 thread, nice
for round in 1 2; do
for b in 1 8 32 64 128; do
  for side in before after; do
    if [ $side = before ]; then dir=/work/main; else dir=/work/wt-expertgemv; fi
    cd $dir
    out=$(nice -n 19 env PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$dir OMP_NUM_THREADS=1 OPENINFER_KERNEL_CACHE=/tmp/kc-expertgemv \
      timeout 300 /work/main/.venv/bin/python scripts/profile_decode_step.py --model /work/bench/dsv3-65m --dtype float32 \
      --batch $b --context 128 --steps 8 --threads 1 2>&1 | grep -E "wall|^\| (moe|linear|attention|other) ")
    echo "round=$round batch=$b side=$side :: $(echo "$out" | tr '\n' ' ')"
  done
done
done
