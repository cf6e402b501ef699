"""Table of the interleaved V4 / V4.1 throughput runs in this folder (output tok/s per batch, V4.1 / V4 ratio per
run pair and its spread)."""
import json
import sys
from pathlib import Path

d = Path(sys.argv[1])
runs = sorted({p.stem.split("-run")[1] for p in d.glob("v4-run*.json")})


def tps(path: Path) -> dict[int, float]:
    data = json.loads(path.read_text())
    return {p["batch_size"]: p["openinfer"]["output_throughput"] for p in data["points"]}


rows = {r: (tps(d / f"v4-run{r}.json"), tps(d / f"v41-run{r}.json")) for r in runs}
print("| batch | " + " | ".join(f"V4 run{r} | V4.1 run{r} | ratio run{r}" for r in runs) + " | ratio min-max |")
print("|---" * (1 + 3 * len(runs) + 1) + "|")
for b in sorted(next(iter(rows.values()))[0]):
    cells, ratios = [], []
    for r in runs:
        v4, v41 = rows[r][0][b], rows[r][1][b]
        ratios.append(v41 / v4)
        cells += [f"{v4:.1f}", f"{v41:.1f}", f"{v41 / v4:.2f}x"]
    print(f"| {b} | " + " | ".join(cells) + f" | {min(ratios):.2f}-{max(ratios):.2f}x |")
