"""The GGUF int8 linears of one forward step of a Llama GGUF file at M activation rows, grouped as the fused decode
block runs them (q/k/v, o, gate/up, down per layer; same-type neighbours concatenated) plus the logits head:
``gguf_linear_q8`` (the small-M op, which hands M >= gguf_q8_tile_from to the tiles) at the SMALL row counts and
``gguf_linear_q8_tiled`` at the others; best of REPS steps. Where a step's linear time goes per M, and where the
tiles pass the small-M kernel. R8: row counts for the same step with the Q4_K / Q6_K groups repacked 8 rows at a
time (``gguf_repack8``, as ``GGUFWeight.repacked`` does at load) through ``gguf_linear_q8`` (the repacked kernel at
every M; other types as before). HUGE_PAGES=1: the R8 weights collapsed into 2 MiB pages first (as after load).

    python scripts/gguf_linears_per_m.py FILE.gguf THREADS 1,8,16,32 REPS [SMALL: 4,8,12] [R8: 1,2,4,8,16,32,64]
"""
import os, sys, time, numpy as np, torch, gguf
path = sys.argv[1]; threads = int(sys.argv[2]); Ms = [int(m) for m in sys.argv[3].split(",")]; reps = int(sys.argv[4])
SMALL = [int(m) for m in sys.argv[5].split(",")] if len(sys.argv) > 5 and sys.argv[5] else []
R8 = [int(m) for m in sys.argv[6].split(",")] if len(sys.argv) > 6 and sys.argv[6] else []
torch.set_num_threads(threads)
from openinfer.layers import dispatch
ops = dispatch.active().ops
r = gguf.GGUFReader(path)
T = {t.name: (int(t.tensor_type), torch.from_numpy(np.array(t.data)).reshape(int(t.shape[1]), -1).contiguous(), int(t.shape[0])) for t in r.tensors if t.name.endswith('weight') and t.tensor_type.name != 'F32'}
def cat(names):
    ts = [T[n] for n in names]; groups = []
    for t in ts:
        if groups and groups[-1][0] == t[0]: groups[-1] = (t[0], torch.cat([groups[-1][1], t[1]]), t[2])
        else: groups.append(t)
    return groups
layers = []
for i in range(sum(1 for n in T if n.endswith('attn_q.weight'))):
    b = f'blk.{i}.'
    layers.append([cat([b+'attn_q.weight', b+'attn_k.weight', b+'attn_v.weight']), cat([b+'attn_output.weight']),
                   cat([b+'ffn_gate.weight', b+'ffn_up.weight']), cat([b+'ffn_down.weight'])])
head = cat(['output.weight'])
nbytes = sum(g[1].numel() for L in layers for lin in L for g in lin) + head[0][1].numel()
print(f"weights {nbytes/1e6:.1f} MB; regions per step {sum(len(lin) for L in layers for lin in L)+1}")


def best_step(op, M):
    """Best of ``reps`` steps of every linear (and the head) through ``op`` at M rows, in seconds."""
    xs = {K: torch.randn(M, K) for K in {g[2] for L in layers for lin in L for g in lin}}

    def step():
        for L in layers:
            for lin in L:
                for (code, data, K) in lin:
                    op(torch.empty(M, data.shape[0]), xs[K], data, code, None)
        op(torch.empty(M, head[0][1].shape[0]), xs[head[0][2]], head[0][1], head[0][0], None)
    step()
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter(); step(); best = min(best, time.perf_counter() - t)
    return best


def repacked(lin):
    return [(code + 1000, ops.gguf_repack8(data, code), K) if code in (12, 14) and data.shape[0] % 8 == 0
            else (code, data, K) for (code, data, K) in lin]


for M in SMALL:
    best = best_step(ops.gguf_linear_q8, M)
    print(f"M={M} t{threads}: {best*1e3:.2f} ms/step, {nbytes/best/1e9:.1f} GB/s")
print("tiled:")
for M in Ms:
    best = best_step(ops.gguf_linear_q8_tiled, M)
    print(f"tiled M={M} t{threads}: {best*1e3:.2f} ms/step, {nbytes/best/1e9:.1f} GB/s")

for M in R8:
    if M == R8[0]:
        layers = [[repacked(lin) for lin in L] for L in layers]
        head = repacked(head)
        if os.environ.get("HUGE_PAGES") == "1":  # the weights in 2 MiB pages, as the engine has them after load
            from openinfer.worker.huge_pages import weights_to_huge_pages
            holder = torch.nn.Module()
            for i, (_, data, _) in enumerate([g for L in layers for lin in L for g in lin] + head):
                holder.register_buffer(f"w{i}", data)
            print(f"huge pages: {weights_to_huge_pages(holder) / 1e6:.1f} MB")
    best = best_step(ops.gguf_linear_q8, M)
    print(f"r8 M={M} t{threads}: {best*1e3:.2f} ms/step, {nbytes/best/1e9:.1f} GB/s")
