"""A/B of two versions of the routed-expert kernel source (``openinfer/layers/cpu_kernels/moe_gemv.cpp``) in one
process (issue 38): each file is built alone under its own op namespace, both run on the same inputs (DeepSeek-V3
shape of issue 38 by default: 5 layers of 32 experts top-6, H 768, I 384, bf16, distinct stacks so the weights come
from memory), their outputs must be equal bit for bit (with and without V4's clamp), and their times are
interleaved round by round with a 256 MiB copy (copy GB/s = bytes read + written).

    git show 9966ddd:openinfer/layers/cpu_kernels/moe_gemv.cpp > /tmp/moe_gemv_old.cpp
    python scripts/moe_gemv_ab.py --base /tmp/moe_gemv_old.cpp --batches 1 8 32 64 128 --rounds 9

Expert GB/s counts the gate / up / down bytes of the experts with rows once per step. Needs a build with
AVX512-BF16 for the ``dot`` path it times (``bf16_dot`` on); elsewhere both run the FMA path.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

KERNELS = Path(__file__).resolve().parents[1] / "openinfer" / "layers" / "cpu_kernels"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast"]


def build(tag: str, source: Path, work: Path):
    d = work / tag
    d.mkdir(parents=True, exist_ok=True)
    f = d / f"moe_{tag}.cpp"
    f.write_text(source.read_text().replace("openinfer_cpu", f"moe_{tag}"))
    cpp_extension.load(name=f"moe_{tag}", sources=[str(f)], extra_cflags=FLAGS + [f"-I{KERNELS}"],
                       extra_ldflags=["-fopenmp"], build_directory=str(d), is_python_module=False)
    return getattr(torch.ops, f"moe_{tag}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, required=True, help="the other version of moe_gemv.cpp")
    p.add_argument("--new", type=Path, default=KERNELS / "moe_gemv.cpp")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--inter", type=int, default=384)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="moe-gemv-ab-"))
    ops = {"base": build("base", a.base, work), "new": build("new", a.new, work)}
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    e, h, i = a.experts, a.hidden, a.inter
    stacks = [((torch.randn(e, 2 * i, h, generator=g) * .05).bfloat16(),
               (torch.randn(e, h, i, generator=g) * .05).bfloat16()) for _ in range(a.layers)]
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    print(f"threads {a.threads}; E {e} top-{a.topk} H {h} I {i} bf16, {a.layers} layers; base {a.base}, new {a.new}")
    for b in a.batches:
        calls = []
        for w13, w2 in stacks:  # each layer its own routing
            ids = torch.stack([torch.randperm(e, generator=g)[:a.topk] for _ in range(b)])
            calls.append((torch.randn(b * a.topk, h, generator=g).bfloat16(),
                          torch.bincount(ids.reshape(-1), minlength=e), w13, w2))
        for limit in (float("inf"), 0.5):
            for rows, counts, w13, w2 in calls:
                out = {t: torch.empty_like(rows) for t in ops}
                for t, o in ops.items():
                    o.moe_experts_gemv(out[t], rows, counts, w13, w2, limit, True)
                assert torch.equal(out["base"], out["new"]), f"batch {b}: the two versions' outputs differ"
        steps = 10 if b <= 32 else 4
        times = {t: [] for t in ops}
        copies = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append(2 * src.nbytes / (time.perf_counter() - t0) / 1e9)
            for t, o in ops.items():
                outs = [torch.empty_like(c[0]) for c in calls]
                for y, c in zip(outs, calls):
                    o.moe_experts_gemv(y, *c, float("inf"), True)
                t0 = time.perf_counter()
                for _ in range(steps):
                    for y, c in zip(outs, calls):
                        o.moe_experts_gemv(y, *c, float("inf"), True)
                times[t].append((time.perf_counter() - t0) / steps * 1e3)
        streamed = sum(int((c[1] > 0).sum()) for c in calls) * 3 * h * i * 2
        mb, mn = statistics.median(times["base"]), statistics.median(times["new"])
        print(f"batch {b:4d}: same bits; base {mb:7.2f} ms ({streamed / mb / 1e6:5.1f} GB/s), new {mn:7.2f} ms "
              f"({streamed / mn / 1e6:5.1f} GB/s), new / base {mn / mb:.3f}; copy {statistics.median(copies):.1f} GB/s",
              flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
