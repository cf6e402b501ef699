"""Profile the prefill of one N-token prompt on the tiny V4.1 curve checkpoint (/tmp/c41/v41): python scripts/profile_prefill.py N

``import openinfer`` resolves as Python does: from this script's directory the installed package (/work/main),
so set PYTHONPATH=<checkout> to profile a worktree (the before / after pairs in
docs/results/decode_curve_131k/2026-12-07_indexer_kernel/ were taken that way).
"""
import sys, time, torch, random
from openinfer import LLM, SamplingParams
n = int(sys.argv[1])
llm = LLM("/tmp/c41/v41", dtype="bfloat16", max_model_len=n + 64, max_num_seqs=8,
          speculative_config={"method": "mtp", "num_speculative_tokens": 3})
rng = random.Random(0)
p = [rng.randrange(256) for _ in range(n)]
sp = SamplingParams(max_tokens=1, temperature=0)
llm.generate([{"prompt_token_ids": p[:2048]}], sp, use_tqdm=False)
t0 = time.perf_counter()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
print("prefill", n, time.perf_counter() - t0, "s")
[print(f"{e.key[:50]:50s} {e.self_cpu_time_total/1e6:8.2f} s {e.count}") for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]]
