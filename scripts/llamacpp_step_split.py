"""scripts/gguf_step_split.py's workload on llama.cpp (llama-cpp-python's low-level batch API, as
openinfer/bench/llamacpp_peer.py drives it): prefill + first token, then 31 decode steps, best of ``reps``.
Runs in llama-cpp-python's venv (imports only llama_cpp and numpy).

    /path/to/llama-venv/bin/python scripts/llamacpp_step_split.py FILE.gguf THREADS 1,8 [REPS]
"""
import sys, time, random
import numpy as np, llama_cpp as L
path = sys.argv[1]; threads = int(sys.argv[2]); batches = [int(b) for b in sys.argv[3].split(",")]
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 3
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
nv = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
rng = random.Random(0)
for B in batches:
    cp = L.llama_context_default_params(); cp.n_ctx = B * 160; cp.n_batch = B * 128; cp.n_seq_max = B
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(B * 128, 0, 1)
    def fill(es):
        for i, (tok, pos, s, lg) in enumerate(es):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1; batch.seq_id[i][0], batch.logits[i] = s, lg
        batch.n_tokens = len(es)
    def step():
        assert L.llama_decode(ctx, batch) == 0
        return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(B * nv,)).reshape(B, nv).argmax(1).tolist()
    def gen(n):
        prompts = [[rng.randrange(100, nv - 1) for _ in range(128)] for _ in range(B)]
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        t = time.perf_counter()
        fill([(tok, pos, s, pos == 127) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]); nxt = step()
        for k in range(1, n):
            fill([(nxt[s], 127 + k, s, True) for s in range(B)]); nxt = step()
        return time.perf_counter() - t
    gen(4)
    p = min(gen(1) for _ in range(reps)); e = min(gen(32) for _ in range(reps))
    print(f"llama.cpp t{threads} B={B}: prefill+1 {p*1e3:.1f} ms, e2e 32 {e*1e3:.1f} ms, decode/step {(e-p)/31*1e3:.2f} ms, e2e tok/s {B*32/e:.1f}", flush=True)
    L.llama_free(ctx)
