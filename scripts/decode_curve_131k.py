"""The vLLM-DeepInfer comparison's decode configuration at small scale (issue 41): ``openinfer bench throughput
--mode decode`` on a tiny V4-shaped and a tiny V4.1-shaped checkpoint, MTP with 3 draft tokens, context up to
131,072, batch 8-256; per-step decode cost against context and batch, and its picture.

  python scripts/decode_curve_131k.py --out docs/results/decode_curve_131k            # the committed run
  python scripts/decode_curve_131k.py --out /tmp/c --contexts 4096 --batches 8 --repeats 1 --decode-steps 2

How the 131k KV is filled: each point's requests share one seeded prefix of ``context - tail`` tokens, computed
once by a priming request and then hit in the prefix cache (``--shared-prefix-len``); each request prefills its
own distinct ``tail`` tokens (its SWA window and the newest compressed entries are its own) and decodes from
there. Each point is one ``bench throughput`` process per (model, context), all batches inside it, and the
whole grid is run ``--repeats`` times, models and contexts alternating, so load drifting on a shared host lands
on every point alike; the JSON keeps every repeat, the picture shows the median and the min-max band.
``--distinct`` runs the control without the shared prefix (every prompt its own, batch x context tokens
prefilled per iteration: small points only), into its own ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = ("v4", "v41")
LABELS = {"v4": "tiny V4-shaped (CSA 4 + HCA 128, top-512)", "v41": "tiny V4.1-shaped (C2 + C1/YOCO, top-512)"}
SPEC = {"method": "mtp", "num_speculative_tokens": 3}


def make_checkpoints(ckpt_dir: Path) -> dict[str, Path]:
    """The "curve" sizes of the two checkpoint scripts; V4 gets a random MTP block in DeepSeek's release layout
    (transformers writes none), V4.1 its DSpark block (4 tokens: up to 3 drafts)."""
    import importlib.util

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    out = {"v4": ckpt_dir / "v4", "v41": ckpt_dir / "v41"}
    if not (out["v4"] / "config.json").exists():
        load("make_deepseek_v4_checkpoint").make_checkpoint(ckpt_dir / "v4-hf", size="curve")
        sys.path.insert(0, str(ROOT / "tests"))
        from tests.test_deepseek_v4 import write_release_with_mtp

        write_release_with_mtp(ckpt_dir / "v4-hf", out["v4"])
    if not (out["v41"] / "config.json").exists():
        load("make_deepseek_v41_checkpoint").make_checkpoint(out["v41"], size="curve")
    return out


def bench_cmd(model: Path, context: int, tail: int, batches: list[int], steps: int, json_path: Path,
              extra: list[str], distinct: bool = False) -> list[str]:
    # distinct: every request's whole prompt its own (prefix cache reset per iteration), the shared prefix's control
    prefix = [] if distinct else ["--shared-prefix-len", str(context - tail)]
    return [sys.executable, "-m", "openinfer", "bench", "throughput", "--model", str(model), "--mode", "decode",
            "--context-len", str(context), *prefix,
            "--decode-steps", str(steps), "--batch-sizes", ",".join(map(str, batches)), "--num-iters", "1",
            "--warmup-iters", "1", "--speculative-config", json.dumps(SPEC), "--output-json", str(json_path),
            *extra]


def run_grid(args: argparse.Namespace, ckpts: dict[str, Path], work: Path) -> list[dict]:
    runs = []
    for r in range(args.repeats):
        for ci, context in enumerate(args.contexts):
            # alternate the model order from one context to the next and from one repeat to the next
            order = list(args.models) if (r + ci) % 2 == 0 else list(reversed(args.models))
            for m in order:
                path = work / f"{m}_{context}_b{'-'.join(map(str, args.batches))}_r{r + args.repeat_offset}.json"
                cmd = bench_cmd(ckpts[m], context, args.tail, args.batches, args.decode_steps, path, args.extra,
                                args.distinct)
                print(f"--- repeat {r + 1}/{args.repeats}: {m} context {context}", flush=True)
                t0 = time.time()
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
                    raise SystemExit(f"bench failed ({proc.returncode}): {' '.join(cmd)}")
                res = json.loads(path.read_text())
                runs.append({"model": m, "context": context, "repeat": r + args.repeat_offset, "wall_s": time.time() - t0,
                             "command": cmd[1:], "result": res})
                for p in res["points"]:
                    s = p["openinfer"]
                    print(f"    batch {s['batch_size']}: {1e3 * s['elapsed_time'] / args.decode_steps:.1f} ms/step, "
                          f"{s['total_output_tokens'] / s['batch_size'] / args.decode_steps:.2f} tok/step/request",
                          flush=True)
    return runs


def collect_runs(work: Path, only: set[tuple[str, int]] | None = None) -> list[dict]:
    """The raw bench JSONs of earlier invocations (named MODEL_CONTEXT_bBATCHES_rREPEAT.json by run_grid);
    ``only``: just these (model, context) pairs."""
    runs = []
    for path in sorted(work.glob("*_r*.json")):
        model, context = path.stem.split("_")[:2]
        if only is not None and (model, int(context)) not in only:
            continue
        model, context, *_, rep = path.stem.split("_")
        res = json.loads(path.read_text())
        runs.append({"model": model, "context": int(context), "repeat": int(rep[1:]), "wall_s": None,
                     "command": res.get("workload", {}).get("command"),
                     "file": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path), "result": res})
    return runs


def reduce(runs: list[dict], steps: int) -> list[dict]:
    """One row per (model, context, batch): per-step and per-output-token cost, median and min-max over repeats."""
    rows: dict[tuple, dict] = {}
    for run in runs:
        for p in run["result"]["points"]:
            s = p["openinfer"]
            key = (run["model"], run["context"], s["batch_size"])
            row = rows.setdefault(key, {"model": key[0], "context": key[1], "batch": key[2], "decode_steps": [],
                                        "ms_per_step": [],
                                        "ms_per_token": [], "tokens_per_step_per_request": [],
                                        "accepted_per_verification": [], "cached_prompt_tokens": [],
                                        "kv_context": []})
            steps = run["result"]["workload"]["decode_steps"]
            ms_step = 1e3 * s["elapsed_time"] / steps
            row["decode_steps"].append(steps)
            row["ms_per_step"].append(ms_step)
            row["ms_per_token"].append(1e3 * s["elapsed_time"] / s["total_output_tokens"])
            row["tokens_per_step_per_request"].append(s["total_output_tokens"] / (s["batch_size"] * steps))
            row["accepted_per_verification"].append(s.get("spec_mean_accepted_length"))
            row["cached_prompt_tokens"].append(s["cached_prompt_tokens"])
            row["kv_context"].append([s.get("kv_context_min"), s.get("kv_context_max")])
    out = []
    for row in rows.values():
        for k in ("ms_per_step", "ms_per_token"):
            v = row[k]
            row[k + "_median"], row[k + "_min"], row[k + "_max"] = statistics.median(v), min(v), max(v)
        out.append(row)
    return sorted(out, key=lambda r: (r["model"], r["batch"], r["context"]))


def predicted(rows: list[dict], configs: dict[str, dict], ns_per_score: float) -> dict[tuple, float]:
    """What the compressed attention says each point should cost: the batch's measured median at its smallest
    context plus the query-key scores the larger context adds (``decode_curve_model.per_request``: index keys and
    HCA entries, 4 queries per request) at ``ns_per_score`` each -> {(model, context, batch): ms per step}."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("decode_curve_model", ROOT / "scripts" / "decode_curve_model.py")
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    out = {}
    for m in {r["model"] for r in rows}:
        for b in {r["batch"] for r in rows if r["model"] == m}:
            pts = sorted((r for r in rows if r["model"] == m and r["batch"] == b), key=lambda r: r["context"])

            def scores(c: int) -> float:
                r = model.per_request(configs[m], c)
                return b * model.QUERIES * (r["index_keys"] + r["hca_entries"])

            base = pts[0]
            for r in pts:
                out[(m, r["context"], b)] = (base["ms_per_step_median"]
                                             + (scores(r["context"]) - scores(base["context"])) * ns_per_score * 1e-6)
    return out


def plot(rows: list[dict], path: Path, caption: str, prediction: dict[tuple, float] | None = None) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    models = sorted({r["model"] for r in rows})
    fig = Figure(figsize=(12, 4.8 * len(models)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(models), 2, squeeze=False)
    for i, m in enumerate(models):
        mine = [r for r in rows if r["model"] == m]
        for j, (key, ylabel) in enumerate((("ms_per_step", "ms per decode step (all requests)"),
                                           ("ms_per_token", "ms per output token (step / tokens emitted)"))):
            ax = axes[i][j]
            for b in sorted({r["batch"] for r in mine}):
                pts = sorted((r for r in mine if r["batch"] == b), key=lambda r: r["context"])
                xs = [r["context"] for r in pts]
                (line,) = ax.plot(xs, [r[key + "_median"] for r in pts], marker="o", label=f"batch {b}")
                ax.fill_between(xs, [r[key + "_min"] for r in pts], [r[key + "_max"] for r in pts],
                                color=line.get_color(), alpha=0.2)
                if prediction and len(pts) > 1:  # dashed: the smallest context's cost + the scores context adds
                    ms = [prediction[(m, r["context"], b)] for r in pts]
                    if key == "ms_per_token":  # the same tokens per step as measured at each point
                        ms = [p * r["ms_per_token_median"] / r["ms_per_step_median"] for p, r in zip(ms, pts)]
                    ax.plot(xs, ms, linestyle="--", color=line.get_color(), alpha=0.7)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["context"] for r in mine}))
            ax.set_xticklabels([f"{c // 1024}k" for c in sorted({r["context"] for r in mine})])
            ax.set_yscale("log")
            ax.set_xlabel("context (KV tokens per request)")
            ax.set_ylabel(ylabel)
            ax.set_title(LABELS.get(m, m), fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.supxlabel(caption, fontsize=7, ha="left", x=0.01)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for decode_curve.json and decode_curve.png")
    ap.add_argument("--ckpt-dir", default="/tmp/openinfer-decode-curve-ckpts")
    ap.add_argument("--models", default="v4,v41")
    ap.add_argument("--contexts", default="4096,16384,32768,65536,131072")
    ap.add_argument("--batches", default="8,32,64,128,256")
    ap.add_argument("--tail", type=int, default=256, help="distinct tokens per request after the shared prefix")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--extra", default="", help="more bench throughput flags, space-separated")
    ap.add_argument("--repeat-offset", type=int, default=0, help="number this invocation's repeats from here")
    ap.add_argument("--distinct", action="store_true",
                    help="the control: distinct prompts (no shared prefix, no prefix-cache hits); prefills "
                         "batch x context tokens per iteration, so only small points are affordable; give it its "
                         "own --out")
    ap.add_argument("--ns-per-score", type=float, default=9.3,
                    help="the dashed prediction's cost of one query-key score (the indexer kernel's marginal cost "
                         "between the V4.1 4k and 131k batch-8 profiles); 0: no prediction")
    ap.add_argument("--also", action="append", default=[], metavar="DIR:MODEL@CONTEXT,...",
                    help="with --replot: also merge the runs of another output directory's runs/ for these "
                         "(model, context) pairs, e.g. an earlier branch's points this one did not re-measure "
                         "(each run keeps its file path in decode_curve.json)")
    ap.add_argument("--host-note", default="how each run was scheduled: the README beside the picture",
                    help="what the caption says of the host's conditions (e.g. 'nice 19', 'alone')")
    ap.add_argument("--replot", action="store_true",
                    help="run nothing: reduce every raw JSON in OUT/runs (from several invocations, each a subset of "
                         "the grid) into decode_curve.json and decode_curve.png")
    args = ap.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        raise SystemExit(f"--models: unknown {bad}; choose from {MODELS}")
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.extra = args.extra.split()
    if min(args.contexts) <= args.tail:
        raise SystemExit(f"--tail {args.tail} must be below the smallest context {min(args.contexts)}")
    out = Path(args.out)
    work = out / "runs"
    work.mkdir(parents=True, exist_ok=True)
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpts = make_checkpoints(ckpt_dir)
    t0 = time.time()
    if args.replot:
        runs = collect_runs(work)
        for spec in args.also:
            where, _, pairs = spec.partition(":")
            only = {(m, int(c)) for m, c in (p.split("@") for p in pairs.split(",") if p)}
            runs += collect_runs(Path(where) / "runs", only)
        args.models = sorted({r["model"] for r in runs})
        args.repeats = len({r["repeat"] for r in runs})  # what the caption and the JSON state
        steps = {r["result"]["workload"]["decode_steps"] for r in runs}
        args.decode_steps = steps.pop() if len(steps) == 1 else "/".join(map(str, sorted(steps)))
    else:
        runs = run_grid(args, ckpts, work)
    rows = reduce(runs, args.decode_steps)
    doc = {"script": "scripts/decode_curve_131k.py", "argv": sys.argv[1:], "speculative_config": SPEC,
           "tail": args.tail, "decode_steps": args.decode_steps, "repeats": args.repeats,
           "grid_wall_s": time.time() - t0, "load_average_end": os.getloadavg(),
           "models": {m: json.loads((ckpts[m] / "config.json").read_text()) for m in args.models},
           "rows": rows,
           "runs": [{k: v for k, v in r.items() if k != "result"} | {
               "engine": r["result"]["engines"]["openinfer"], "environment": r["result"]["environment"],
               "workload": r["result"]["workload"]} for r in runs]}
    (out / "decode_curve.json").write_text(json.dumps(doc, indent=1) + "\n")
    shared = {r["result"]["workload"].get("shared_prefix_len", 0) > 0 for r in runs}
    if len(shared) > 1:
        raise SystemExit(f"{work}: shared-prefix and --distinct runs mixed in one directory")
    prompts = (f"shared prefix = context - {args.tail} (prefilled once, prefix-cache hits)" if shared.pop() else
               "distinct prompts (no prefix-cache hits)")
    caption = (f"openinfer bench throughput --mode decode, MTP k=3, {prompts}, {args.decode_steps} timed steps; "
               f"median of up to {args.repeats} repeats, band = min-max; 2-core shared CPU host ({args.host_note})")
    prediction = None
    if args.ns_per_score > 0:
        prediction = predicted(rows, doc["models"], args.ns_per_score)
        caption += (f"\ndashed: the smallest context's median + the query-key scores the context adds (index keys, "
                    f"HCA entries; scripts/decode_curve_model.py) at {args.ns_per_score} ns each")
        for r in rows:
            r["predicted_ms_per_step"] = prediction[(r["model"], r["context"], r["batch"])]
        (out / "decode_curve.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(rows, out / "decode_curve.png", caption, prediction)
    print(f"wrote {out / 'decode_curve.json'} and {out / 'decode_curve.png'}")


if __name__ == "__main__":
    main()
