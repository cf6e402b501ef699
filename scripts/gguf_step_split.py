"""Prefill / decode split of one GGUF file in openinfer, in process: per batch B, B prompts of 128 random tokens,
generate 1 token (prefill + first token) and 32 tokens (prompt ids drawn from 100..30999: a vocabulary of at
least 31,000 tokens, as the Llama bench checkpoint's 32,000), best of ``reps`` each; decode per step = the difference / 31.
Run with OPENINFER_GGUF_ACTIVATIONS=int8 for llama.cpp's arithmetic; scripts/llamacpp_step_split.py is the same
workload on llama.cpp (its venv), for the split ``bench peers`` does not report.

    python scripts/gguf_step_split.py FILE.gguf THREADS 1,8 [REPS] [file-layout]

``file-layout`` keeps the file's Q4_K / Q6_K rows as they are (``GGUFWeight.repacked`` off for this process: the
small-M and tile kernels on the file's bytes, as before the load-time repack), for an A/B of the repack.
"""
import sys, time, random, torch
path = sys.argv[1]; threads = int(sys.argv[2]); batches = [int(b) for b in sys.argv[3].split(",")]
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 3
torch.set_num_threads(threads)
if len(sys.argv) > 5 and sys.argv[5] == "file-layout":
    from openinfer.layers import gguf_quant
    gguf_quant.GGUFWeight.repacked = lambda self: self
    gguf_quant.GGUFWeightParts.repacked = lambda self: self
from openinfer import LLM, SamplingParams
llm = LLM(path, dtype="float32", max_model_len=200, max_num_seqs=64, max_num_batched_tokens=2048)
rng = random.Random(0)
def run(B, n):
    prompts = [{"prompt_token_ids": [rng.randrange(100, 31000) for _ in range(128)]} for _ in range(B)]
    sp = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
    t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); return time.perf_counter() - t
for B in batches:
    run(B, 4)
    p = min(run(B, 1) for _ in range(reps)); e = min(run(B, 32) for _ in range(reps))
    print(f"openinfer{' (file layout)' if len(sys.argv) > 5 else ''} t{threads} B={B}: prefill+1 {p*1e3:.1f} ms, e2e 32 {e*1e3:.1f} ms, decode/step {(e-p)/31*1e3:.2f} ms, e2e tok/s {B*32/e:.1f}", flush=True)
