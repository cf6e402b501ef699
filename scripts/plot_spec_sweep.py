#!/usr/bin/env python
"""Plot a speculative-decoding k sweep: one `openinfer bench throughput` JSON per k (k0.json = off, k1.json, ...)
-> output tok/s and acceptance vs batch size, one line per k.

    python scripts/plot_spec_sweep.py benchmarks/results/spec-decode-mtp-tiny
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(folder: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = Path(folder)
    runs = sorted(d.glob("k*.json"), key=lambda p: int(p.stem[1:]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = []
    for f in runs:
        res = json.loads(f.read_text())
        k = int(f.stem[1:])
        pts = [(p["batch_size"], p["openinfer"]) for p in res["points"]]
        xs = [b for b, _ in pts]
        ax1.plot(xs, [s["output_throughput"] for _, s in pts], marker="o", label="off" if k == 0 else f"k={k}")
        if k:
            ax2.plot(xs, [s.get("spec_acceptance_rate", 0.0) for _, s in pts], marker="o", label=f"k={k}")
        rows += [(k, b, s["output_throughput"], s.get("spec_acceptance_rate"), s.get("spec_mean_accepted_length"))
                 for b, s in pts]
    for ax, label in ((ax1, "output tokens/s"), (ax2, "draft acceptance rate")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    env = json.loads(runs[0].read_text())["environment"]
    fig.suptitle(f"MTP speculative decoding, {env['model']['architecture']} ({Path(env['model']['path']).name}), "
                 f"{env['cpu_model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(d / "spec-sweep.png", dpi=120)
    print("k | batch | output tok/s | acceptance | tokens per verification")
    for k, b, tps, acc, mal in rows:
        print(f"{k} | {b} | {tps:.1f} | {'' if acc is None else f'{acc:.1%}'} | {'' if mal is None else f'{mal:.2f}'}")


if __name__ == "__main__":
    main(sys.argv[1])
