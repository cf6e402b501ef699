"""In-process A/B of the load-time repack (``GGUFWeight.repacked``) on a GGUF file's Q4_K / Q6_K layer weights: at
each M, every such weight through ``gguf_linear_q8`` on the file's bytes (small-M kernel, tiles from
``gguf_q8_tile_from`` rows), through the same entry on the repacked bytes (the repacked kernel, tiles on the
repacked rows from ``gguf_r8_tile_from``), and through ``gguf_linear_q8_r8`` (the repacked kernel alone), the
three alternating, best of REPS each. Run it under the bench lock.

    python scripts/gguf_repack_ab.py FILE.gguf THREADS 8,32,128,1024 REPS
"""
import sys, time, numpy as np, torch, gguf
path = sys.argv[1]; torch.set_num_threads(int(sys.argv[2])); Ms = [int(m) for m in sys.argv[3].split(",")]; reps = int(sys.argv[4])
from openinfer.layers import dispatch
ops = dispatch.active().ops
r = gguf.GGUFReader(path)
W = [(int(t.tensor_type), torch.from_numpy(np.array(t.data)).reshape(int(t.shape[1]), -1).contiguous(), int(t.shape[0])) for t in r.tensors if t.name.startswith('blk.') and t.tensor_type.name in ('Q4_K', 'Q6_K')]
R = [(c + 1000, ops.gguf_repack8(d, c), K) for c, d, K in W]
def step(ws, op, M, xs):
    for c, d, K in ws:
        op(torch.empty(M, d.shape[0]), xs[K], d, c, None)  # the 200M file's N are multiples of 8
for M in Ms:
    xs = {K: torch.randn(M, K) for K in {w[2] for w in W}}
    best = {}
    for name, ws, op in [("file tiles" if M >= 12 else "file small-M", W, ops.gguf_linear_q8), ("r8 entry", R, ops.gguf_linear_q8), ("r8 kernel", R, ops.gguf_linear_q8_r8)] * reps:
        t = time.perf_counter(); step(ws, op, M, xs); best[name] = min(best.get(name, 1e9), time.perf_counter() - t)
    print(f"M={M}: " + "  ".join(f"{k} {v*1e3:.1f} ms" for k, v in best.items()), flush=True)
