"""The fused decode layers of one decode step, timed alone: a Llama-family GGUF file loaded by ``LLM``, one request
of 128 random tokens generating 30, the last step's ``llama_decode_layers`` call captured and replayed REPS times
(median and min of 3 rounds, ms). Without the engine's per-step Python and the logits head, so an A/B of a kernel
change (two checkouts, alternating fresh processes) sees the layers only; the step split (gguf_step_split.py) says
what the whole step does.

    OPENINFER_GGUF_ACTIVATIONS=int8 python scripts/gguf_layers_replay.py FILE.gguf THREADS [REPS]
"""
import random, statistics, sys, time
import torch

path, threads = sys.argv[1], int(sys.argv[2])
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 300
torch.set_num_threads(threads)
from openinfer import LLM, SamplingParams
from openinfer.layers import cpu_ops

llm = LLM(path, dtype="float32", max_model_len=400, max_num_seqs=8)
real = cpu_ops.get_ops()
captured = {}


class Capture:
    """The kernel namespace, with ``llama_decode_layers`` keeping its arguments."""

    def __getattr__(self, name):
        if name != "llama_decode_layers":
            return getattr(real, name)

        def call(*args):
            captured["args"] = args
            return real.llama_decode_layers(*args)
        return call


cpu_ops.get_ops = lambda: Capture()
rng = random.Random(0)
llm.generate([{"prompt_token_ids": [rng.randrange(100, 31000) for _ in range(128)]}],
             SamplingParams(temperature=0.0, max_tokens=30, min_tokens=30, ignore_eos=True), use_tqdm=False)
if "args" not in captured:
    sys.exit("no fused decode step ran (not a Llama-family model, or OPENINFER_DECODE_BLOCKS=0)")
args = captured["args"]
x0 = args[0].clone()  # the op adds into x in place: each replay starts from the captured input


def fused():
    real.llama_decode_layers(x0.clone(), *args[1:])


def timed(fn, n):
    for _ in range(10):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3, min(ts) * 1e3


rounds = [timed(fused, reps) for _ in range(3)]
print(f"fused layers t{threads}: median {statistics.median(r[0] for r in rounds):.3f} ms, "
      f"min {min(r[1] for r in rounds):.3f} ms")
