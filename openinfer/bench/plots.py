"""PNG charts of benchmark curves (matplotlib, Agg). Shared by ``bench compare --plot`` and report commands.

Figures are built with ``matplotlib.figure.Figure`` and rendered by the Agg canvas directly, never through
pyplot, so importing this module changes no global backend and no state leaks between plots.

Every chart carries a caption with the provenance of each curve (who measured, hardware, date, command, or
"read off chart"): a throughput line without it cannot be checked. Curves read off a published chart are
drawn dashed with hollow markers, so a reading never looks like a run.
"""
from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FormatStrFormatter

from openinfer.bench.curves import Comparison, Curve, pareto_frontier

AXIS_LABELS = {
    "batch_size": "batch size (requests in flight)",
    "concurrency": "concurrency (requests in flight)",
    "interactivity": "interactivity (tok/s/user)",
    "p90_interactivity": "p90 interactivity (tok/s/user, 1 / p90 ITL)",
    "output_throughput": "output tok/s",
    "total_token_throughput": "total tok/s (input + output)",
    "output_throughput_per_device": "output tok/s/device",
    "total_token_throughput_per_device": "total tok/s/device (input + output)",
    "input_throughput_per_device": "input tok/s/device",
}


def axis_label(metric: str) -> str:
    return AXIS_LABELS.get(metric, metric)


def provenance_caption(curves: Sequence[Curve]) -> str:
    """One line per curve: who measured, on what, when, and how (command or chart source)."""
    lines = []
    for c in curves:
        m = c.meta
        if c.read_off_chart:
            how = f"read off chart {m.get('source_url') or '(source not given)'}"
        else:
            how = f"measured by {m.get('measured_by') or '?'}"
            if m.get("runner"):
                how += f" ({m['runner']})"
        parts = [f"{c.label}: {how}", f"hardware {m.get('hardware') or '?'}",
                 f"{m.get('num_devices') or '?'} device(s)", f"date {m.get('date') or '?'}"]
        if m.get("command"):
            parts.append(f"cmd: {m['command']}")
        lines.append("; ".join(parts))
    return "\n".join(lines)


def _new_figure(rows: int = 1, height_ratios: list[int] | None = None) -> tuple[Figure, list]:
    fig = Figure(figsize=(9, 5.5 + 2.2 * (rows - 1)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": height_ratios} if height_ratios else None)[:, 0]
    return fig, list(axes)


def _style(c: Curve) -> dict:
    if c.read_off_chart:
        return {"linestyle": "--", "marker": "o", "markerfacecolor": "none"}
    return {"linestyle": "-", "marker": "o"}


def _legend_name(c: Curve) -> str:
    return f"{c.label} (read off chart)" if c.read_off_chart else c.label


def _save(fig: Figure, path: str | Path, caption: str) -> Path:
    wrapped = "\n".join(textwrap.fill(line, 130, subsequent_indent="    ") for line in caption.splitlines())
    # A separate row under the axes keeps the caption from overlapping tick labels at any length.
    fig.supxlabel(wrapped, fontsize=7, ha="left", x=0.01, multialignment="left")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=120)
    return out


def _log2_x(ax) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))  # 1, 8, 32 rather than 2^0, 2^3, 2^5


def _check(curves: Sequence[Curve]) -> None:
    if not curves:
        raise ValueError("nothing to plot: no curves")


def plot_throughput_vs_batch(curves: list[Curve], path: str | Path, *, y_label: str, caption: str) -> Path:
    """One line per curve over batch size (log2 axis), a marker at every measured point."""
    _check(curves)
    fig, (ax,) = _new_figure()
    for c in curves:
        ax.plot(c.xs, c.ys, label=_legend_name(c), **_style(c))
    _log2_x(ax)
    ax.set_xlabel(axis_label(curves[0].x_metric))
    ax.set_ylabel(y_label)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, path, caption)


def plot_pareto(curves: list[Curve], path: str | Path, *, caption: str) -> Path:
    """x = interactivity (tok/s/user), y = tok/s/device; all points faint, each curve's Pareto frontier
    drawn as a line."""
    _check(curves)
    fig, (ax,) = _new_figure()
    for c in curves:
        front, _ = pareto_frontier(c)
        (line,) = ax.plot(front.xs, front.ys, label=_legend_name(c), **_style(c))
        ax.scatter(c.xs, c.ys, s=14, alpha=0.35, color=line.get_color())
    ax.set_xlabel(axis_label(curves[0].x_metric))
    ax.set_ylabel(axis_label(curves[0].y_metric))
    ax.grid(True, alpha=0.3)
    ax.legend(title="Pareto frontier")
    return _save(fig, path, caption)


def plot_compare(comparisons: list[Comparison], path: str | Path, *, caption: str,
                 log_x: bool = False) -> Path:
    """Top: every curve as measured. Bottom: other/baseline at each compared x, with the +-within% band;
    hollow ratio markers where one side was interpolated. Excluded points appear only in the top panel."""
    if not comparisons:
        raise ValueError("nothing to plot: no comparisons")
    fig, (top, bottom) = _new_figure(2, [3, 2])
    base = comparisons[0].baseline
    curves = [base] + [c.other for c in comparisons]
    colors = {}
    for c in curves:
        name = _legend_name(c) + (" [baseline]" if c is base else "")
        (line,) = top.plot(c.xs, c.ys, label=name, **_style(c))
        colors[c.label] = line.get_color()
    bottom.axhline(1.0, color="black", linewidth=0.8)
    w = comparisons[0].within_pct
    bottom.axhspan(1 - w / 100, 1 + w / 100, color="green", alpha=0.12, label=f"within {w:g}%")
    any_interp = False
    for cmp in comparisons:
        if not cmp.points:
            continue
        color = colors[cmp.other.label]  # the ratio line wears the colour of the curve it divides
        bottom.plot([p.x for p in cmp.points], [p.ratio for p in cmp.points], color=color,
                    label=f"{cmp.other.label} / {base.label}")
        meas = [(p.x, p.ratio) for p in cmp.points if p.a_measured and p.b_measured]
        interp = [(p.x, p.ratio) for p in cmp.points if not (p.a_measured and p.b_measured)]
        if meas:
            bottom.scatter(*zip(*meas), color=color, zorder=3)
        if interp:
            bottom.scatter(*zip(*interp), facecolors="white", edgecolors=color, zorder=3)
            any_interp = True
    if any_interp:
        bottom.scatter([], [], facecolors="white", edgecolors="gray", label="hollow: one side interpolated")
    if log_x:
        _log2_x(top)
    top.set_ylabel(axis_label(base.y_metric))
    top.grid(True, which="both", alpha=0.3)
    top.legend()
    bottom.set_ylabel("ratio to baseline")
    bottom.set_xlabel(axis_label(base.x_metric))
    bottom.grid(True, which="both", alpha=0.3)
    bottom.legend(fontsize=8)
    return _save(fig, path, caption)
