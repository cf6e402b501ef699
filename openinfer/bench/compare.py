"""``openinfer bench compare``: is curve B "within N%" of curve A, point by point, and under what conditions?

Curves come from any result files ``result_files`` reads (throughput, bench serve sweeps, CSVs read off a
chart). The first curve (or ``--baseline``) is A; every other curve is compared with it on the x range both
cover, interpolating monotonically where grids differ (``curves.compare_curves``). Next to the numbers the
command prints what differs between the runs, since a gap measured on different hardware, device counts or
context lengths is not an engine comparison.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from openinfer.bench.curves import (LOG_X_METRICS, PROVENANCE_FIELDS, Comparison, Curve, compare_curves,
                                    differing_fields, provenance)
from openinfer.bench.result_files import INTERACTIVITY_SOURCES, load_curves


def _percent(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite percentage > 0, got {text!r}")
    return v


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", metavar="RESULT",
                   help="result files: throughput JSON (FILE:engine picks one engine), bench serve JSON "
                        "(files of one label+model form one curve), or a chart CSV")
    p.add_argument("--x", default="batch_size",
                   help="x field: batch_size, concurrency, interactivity (tok/s/user), or any numeric field")
    p.add_argument("--y", default="output_throughput",
                   help="y field: output_throughput, total_token_throughput, "
                        "output_throughput_per_device, ...")
    p.add_argument("--within", type=_percent, default=6.0, help="claimed maximum gap, percent (default 6)")
    p.add_argument("--baseline", default="FIRST", help="label of curve A (default: the first curve)")
    p.add_argument("--interactivity", choices=sorted(INTERACTIVITY_SOURCES), default="median-tpot",
                   help="bench serve interactivity: 1000/median_tpot_ms or 1000/p90_itl_ms")
    p.add_argument("--output-json", default=None, help="write the comparison as JSON")
    p.add_argument("--plot", default=None, help="write curves + ratio chart as PNG")


def pick_baseline(curves: list[Curve], label: str) -> tuple[Curve, list[Curve]]:
    if len(curves) < 2:
        raise ValueError(f"compare needs at least two curves, got {len(curves)}: "
                         f"{', '.join(c.label for c in curves)}")
    if label == "FIRST":
        return curves[0], curves[1:]
    for i, c in enumerate(curves):
        if c.label == label:
            return c, curves[:i] + curves[i + 1:]
    raise ValueError(f"--baseline {label!r} is not a curve; curves: {', '.join(c.label for c in curves)}")


def comparison_json(cmp: Comparison, differing: list[str]) -> dict[str, Any]:
    return {
        "baseline": cmp.baseline.label,
        "other": cmp.other.label,
        "x_metric": cmp.baseline.x_metric,
        "y_metric": cmp.baseline.y_metric,
        "within_pct": cmp.within_pct,
        "within": cmp.within,
        "max_gap_pct": cmp.max_gap_pct,
        "mean_gap_pct": cmp.mean_gap_pct,
        "common_range": list(cmp.common_range) if cmp.common_range else None,
        "verdict": cmp.verdict(),
        "conditions_differ": differing,
        "read_off_chart": [c.label for c in (cmp.baseline, cmp.other) if c.read_off_chart],
        "points": [{"x": p.x, "baseline": p.a, "other": p.b, "ratio": p.ratio, "gap_pct": p.gap_pct,
                    "baseline_measured": p.a_measured, "other_measured": p.b_measured} for p in cmp.points],
        "excluded": [{"curve": e.label, "x": e.x, "y": e.y, "reason": e.reason} for e in cmp.excluded],
    }


def curve_json(c: Curve) -> dict[str, Any]:
    return {"label": c.label, "x_metric": c.x_metric, "y_metric": c.y_metric, "xs": c.xs, "ys": c.ys,
            "read_off_chart": c.read_off_chart, "meta": c.meta}


def main(args: argparse.Namespace) -> int:
    curves = load_curves(args.results, args.x, args.y, interactivity=args.interactivity)
    base, others = pick_baseline(curves, args.baseline)
    ordered = [base] + others
    print_conditions(ordered)
    comparisons = []
    report = []
    for other in others:
        cmp = compare_curves(base, other, args.within)
        differing = differing_fields([base, other])
        comparisons.append(cmp)
        report.append(comparison_json(cmp, differing))
        print_comparison(cmp, differing)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(
            {"curves": [curve_json(c) for c in ordered], "comparisons": report}, indent=2, default=str))
        print(f"wrote {args.output_json}")
    if args.plot:
        from openinfer.bench.plots import plot_compare, provenance_caption

        out = plot_compare(comparisons, args.plot, caption=provenance_caption(ordered),
                           log_x=args.x in LOG_X_METRICS)
        print(f"wrote {out}")
    return 0


def print_conditions(curves: list[Curve]) -> None:
    """What each run was, one row per provenance field; '*' marks rows that differ or are unknown."""
    differing = set(differing_fields(curves))
    cells = [[provenance(c, k) for c in curves] for k in PROVENANCE_FIELDS]
    widths = [max(len(c.label), *(len(row[i]) for row in cells)) for i, c in enumerate(curves)]
    widths = [min(w, 40) for w in widths]
    print("\nConditions ('*' = differs or unknown)")
    print(f"  {'':14} " + " | ".join(c.label[:w].ljust(w) for c, w in zip(curves, widths)))
    for key, row in zip(PROVENANCE_FIELDS, cells):
        mark = "*" if key in differing else " "
        print(f"{mark} {key:14} " + " | ".join(v[:w].ljust(w) for v, w in zip(row, widths)))


def print_comparison(cmp: Comparison, differing: list[str]) -> None:
    a, b = cmp.baseline, cmp.other
    print(f"\n{b.label} vs {a.label}: {a.y_metric} by {a.x_metric}")
    head = f"{a.x_metric:>14} | {a.label[:14]:>14} | {b.label[:14]:>14} | {'ratio':>7} | {'gap %':>6} | note"
    print(head)
    print("-" * len(head))
    for p in cmp.points:
        sides = ((a, p.a_measured), (b, p.b_measured))
        note = ", ".join(f"{c.label} interpolated" for c, measured in sides if not measured)
        print(f"{p.x:>14g} | {p.a:>14.4g} | {p.b:>14.4g} | {p.ratio:>7.3f} | {p.gap_pct:>6.1f} | {note}")
    for e in cmp.excluded:
        print(f"excluded: {e.label} at {a.x_metric} {e.x:g} ({a.y_metric} {e.y:.4g}): {e.reason}")
    print(f"verdict: {cmp.verdict()}")
    like = [k for k in differing if k not in ("date", "measured_by", "source")]
    if like:
        print(f"caveat: not like for like, these differ or are unknown: {', '.join(like)}")
