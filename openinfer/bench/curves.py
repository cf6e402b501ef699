"""Whole-curve comparison math: the ``Curve`` type, monotone interpolation, Pareto frontiers, gap statistics.

No I/O here: loaders live in ``result_files.py``, printing in ``compare.py``, drawing in ``plots.py``.

A claim such as "B is within 6% of A across batch sizes 8-256" is checked by putting both curves on one grid
(the union of their measured x values inside the range both cover), reading each curve there (measured, or
interpolated between its own neighbours) and taking the worst |1 - B/A|. Two rules keep the check honest:

* never extrapolate: x values outside the common range are excluded and reported, not guessed;
* interpolate monotonically (Steffen 1990): between two measured points the interpolant stays between their
  values, so interpolation can never invent a peak or a dip that would shrink or widen a gap.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# x metrics sampled on geometric grids (1, 2, 4, ... or 8, 16, 32): interpolating in log2(x) spaces the
# segments evenly, as the sweep intended; linear x would let the widest segment dominate the shape.
LOG_X_METRICS = frozenset({"batch_size", "concurrency", "max_concurrency"})


@dataclass
class Curve:
    """One line of a benchmark chart: y (a throughput, a cost ...) as a function of x.

    Construct it directly when you have numbers in hand::

        Curve(label="openinfer", xs=[1, 8, 32], ys=[7.7, 52.1, 120.4],
              x_metric="batch_size", y_metric="output_throughput",
              meta={"hardware": "AMD EPYC", "measured_by": "openinfer bench throughput"},
              read_off_chart=False)

    label: legend name, unique within one comparison.
    xs, ys: measured points, any order; stored sorted by x. x values must be distinct and all values finite.
    x_metric, y_metric: field names (vLLM / InferenceX spelling: ``batch_size``, ``concurrency``,
        ``interactivity`` = tok/s/user, ``output_throughput``, ``total_token_throughput_per_device`` ...).
    meta: provenance, free-form; the keys in ``PROVENANCE_FIELDS`` are shown in comparison tables and
        plot captions ("?" where absent).
    read_off_chart: True when the numbers were read off someone's published chart rather than measured;
        every verdict and caption that uses the curve says so.
    """

    label: str
    xs: list[float]
    ys: list[float]
    x_metric: str
    y_metric: str
    meta: dict[str, Any] = field(default_factory=dict)
    read_off_chart: bool = False

    def __post_init__(self) -> None:
        xs = [float(x) for x in self.xs]
        ys = [float(y) for y in self.ys]
        if len(xs) != len(ys):
            raise ValueError(f"curve {self.label!r}: {len(xs)} x values but {len(ys)} y values")
        if not xs:
            raise ValueError(f"curve {self.label!r}: no points")
        for x, y in zip(xs, ys):
            if not (math.isfinite(x) and math.isfinite(y)):
                raise ValueError(f"curve {self.label!r}: point ({x}, {y}) is not finite")
        order = sorted(range(len(xs)), key=xs.__getitem__)
        xs = [xs[i] for i in order]
        ys = [ys[i] for i in order]
        dup = [a for a, b in zip(xs, xs[1:]) if a == b]
        if dup:
            raise ValueError(f"curve {self.label!r}: x = {dup[0]:g} appears twice; merge repeated runs first")
        self.xs, self.ys = xs, ys

    def __len__(self) -> int:
        return len(self.xs)


# Provenance rows shown for every curve, in this order (the "what differs between runs" table).
PROVENANCE_FIELDS = (
    "hardware", "device", "num_devices", "parallel", "model", "dtype",
    "input_len", "output_len", "context_len", "spec_decoding", "measured_by", "source", "date",
)


def provenance(curve: Curve, key: str) -> str:
    """One provenance cell: the meta value as text, "?" where unknown."""
    if key == "source":
        return "read off chart" if curve.read_off_chart else str(curve.meta.get("source") or "measured")
    v = curve.meta.get(key)
    return "?" if v is None or v == "" else str(v)


def differing_fields(curves: Sequence[Curve]) -> list[str]:
    """Provenance rows whose values are not the same for every curve (an unknown counts as different)."""
    out = []
    for key in PROVENANCE_FIELDS:
        vals = {provenance(c, key) for c in curves}
        if len(vals) > 1 or "?" in vals:
            out.append(key)
    return out


# -- monotone interpolation -------------------------------------------------------------------------


def _steffen_slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Node derivatives of Steffen's monotone cubic (A&A 239, 443, 1990).

    Each derivative is bounded by twice the smaller neighbouring secant and is zero at a local extremum, which
    keeps the Hermite cubic on every segment between its two end values (no overshoot)."""
    h = np.diff(x)
    s = np.diff(y) / h
    n = len(x)
    d = np.zeros(n)
    if n == 2:
        d[:] = s[0]
        return d
    p = (s[:-1] * h[1:] + s[1:] * h[:-1]) / (h[:-1] + h[1:])
    bound = np.minimum.reduce([np.abs(s[:-1]), np.abs(s[1:]), 0.5 * np.abs(p)])
    d[1:-1] = (np.sign(s[:-1]) + np.sign(s[1:])) * bound
    # End points: Steffen's one-sided parabola, clipped to the same bounds.
    for i, (s0, s1, h0, h1) in ((0, (s[0], s[1], h[0], h[1])), (n - 1, (s[-1], s[-2], h[-1], h[-2]))):
        p0 = s0 * (1 + h0 / (h0 + h1)) - s1 * h0 / (h0 + h1)
        if p0 * s0 <= 0:
            d[i] = 0.0
        elif abs(p0) > 2 * abs(s0):
            d[i] = 2 * s0
        else:
            d[i] = p0
    return d


def interp_monotone(xs: Sequence[float], ys: Sequence[float], x_new: Sequence[float] | float,
                    *, log_x: bool = False) -> np.ndarray:
    """Steffen monotone cubic through (xs, ys) evaluated at x_new; exact at the nodes.

    Raises ValueError for any x_new outside [min(xs), max(xs)]: this function never extrapolates.
    log_x interpolates in log2(x) (for geometric sweeps); then every x must be > 0.
    """
    x = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    q = np.atleast_1d(np.asarray(x_new, dtype=float))
    if len(x) != len(y) or len(x) == 0:
        raise ValueError("interp_monotone: xs and ys must be non-empty and of equal length")
    if np.any(np.diff(x) <= 0):
        raise ValueError("interp_monotone: xs must be strictly increasing")
    lo, hi = x[0], x[-1]
    outside = q[(q < lo) | (q > hi)]
    if outside.size:
        raise ValueError(f"x = {outside[0]:g} is outside the measured range [{lo:g}, {hi:g}]; "
                         f"refusing to extrapolate")
    if len(x) == 1:
        return np.full(q.shape, y[0])
    if log_x:
        if lo <= 0:
            raise ValueError(f"log-x interpolation needs x > 0, got x = {lo:g}")
        x, q = np.log2(x), np.log2(q)
    d = _steffen_slopes(x, y)
    i = np.clip(np.searchsorted(x, q, side="right") - 1, 0, len(x) - 2)
    h = x[i + 1] - x[i]
    t = (q - x[i]) / h
    t2, t3 = t * t, t * t * t
    out = ((2 * t3 - 3 * t2 + 1) * y[i] + (t3 - 2 * t2 + t) * h * d[i]
           + (-2 * t3 + 3 * t2) * y[i + 1] + (t3 - t2) * h * d[i + 1])
    # Land exactly on measured values (the cubic does up to rounding).
    exact = np.isin(q, x)
    out[exact] = y[np.searchsorted(x, q[exact])]
    return out


# -- Pareto frontier --------------------------------------------------------------------------------


def pareto_frontier(curve: Curve) -> tuple[Curve, list[tuple[float, float]]]:
    """Points no other point beats on both axes (higher x and higher y are both better: tok/s/user and
    tok/s/device). Returns the frontier as a curve (y falls as x rises) and the dominated points dropped."""
    keep: list[int] = []
    best_y = -math.inf
    # Walk from the highest x down: a point survives if its y beats every point with larger x.
    for i in range(len(curve) - 1, -1, -1):
        if curve.ys[i] > best_y:
            keep.append(i)
            best_y = curve.ys[i]
    keep.reverse()
    dropped = [(curve.xs[i], curve.ys[i]) for i in range(len(curve)) if i not in keep]
    front = Curve(label=curve.label, xs=[curve.xs[i] for i in keep], ys=[curve.ys[i] for i in keep],
                  x_metric=curve.x_metric, y_metric=curve.y_metric, meta=dict(curve.meta),
                  read_off_chart=curve.read_off_chart)
    return front, dropped


# -- comparison -------------------------------------------------------------------------------------


@dataclass
class PointGap:
    """B against A at one x. ``*_measured`` False means that side was interpolated between its neighbours."""

    x: float
    a: float
    b: float
    a_measured: bool
    b_measured: bool

    @property
    def ratio(self) -> float:
        return self.b / self.a

    @property
    def gap_pct(self) -> float:
        return abs(1.0 - self.ratio) * 100.0


@dataclass
class Excluded:
    label: str
    x: float
    y: float
    reason: str


@dataclass
class Comparison:
    """B (``other``) measured against A (``baseline``) over the x range both curves cover."""

    baseline: Curve
    other: Curve
    within_pct: float
    points: list[PointGap]
    excluded: list[Excluded]
    common_range: tuple[float, float] | None

    @property
    def max_gap_pct(self) -> float | None:
        return max((p.gap_pct for p in self.points), default=None)

    @property
    def mean_gap_pct(self) -> float | None:
        return sum(p.gap_pct for p in self.points) / len(self.points) if self.points else None

    @property
    def within(self) -> bool | None:
        """True/False for the "within N%" claim over the common range; None when the curves share no x."""
        return None if not self.points else self.max_gap_pct <= self.within_pct

    def verdict(self) -> str:
        a, b = self.baseline, self.other
        if not self.points:
            return (f"{b.label} vs {a.label}: no common {a.x_metric} range "
                    f"({_span(a)} vs {_span(b)}); no verdict")
        lo, hi = self.common_range
        n_interp = sum(not (p.a_measured and p.b_measured) for p in self.points)
        word = "within" if self.within else "NOT within"
        text = (f"{b.label} is {word} {self.within_pct:g}% of {a.label} on {a.y_metric} over "
                f"{a.x_metric} {lo:g}-{hi:g}: max gap {self.max_gap_pct:.1f}%, mean {self.mean_gap_pct:.1f}% "
                f"({len(self.points)} points, {n_interp} with an interpolated side")
        if self.excluded:
            text += f", {len(self.excluded)} excluded"
        text += ")"
        charts = [c.label for c in (a, b) if c.read_off_chart]
        if charts:
            text += (f"; {', '.join(charts)} read off a published chart, not measured in this run, "
                     f"so this compares a run with a reading, not two runs")
        return text


def _span(c: Curve) -> str:
    return f"[{c.xs[0]:g}, {c.xs[-1]:g}]"


def is_pareto_axis(x_metric: str) -> bool:
    """x metrics where higher is better for the user (tok/s/user): charts against them are Pareto fronts."""
    return "interactivity" in x_metric


def compare_curves(baseline: Curve, other: Curve, within_pct: float, *, log_x: bool | None = None,
                   pareto: bool | None = None) -> Comparison:
    """Ratio other/baseline on the union of both x grids inside the common range.

    log_x defaults to True for geometric sweeps (``LOG_X_METRICS``). pareto (default: for interactivity x)
    first reduces each curve to its Pareto frontier, as InferenceX charts do; dominated points are excluded
    and reported.
    """
    if not (within_pct > 0 and math.isfinite(within_pct)):
        raise ValueError(f"within must be a finite percentage > 0, got {within_pct}")
    if baseline.x_metric != other.x_metric or baseline.y_metric != other.y_metric:
        raise ValueError(f"curves measure different things: {baseline.label!r} is {baseline.y_metric} vs "
                         f"{baseline.x_metric}, {other.label!r} is {other.y_metric} vs {other.x_metric}")
    if log_x is None:
        log_x = baseline.x_metric in LOG_X_METRICS
    dominated: list[Excluded] = []
    if pareto if pareto is not None else is_pareto_axis(baseline.x_metric):
        fronts = []
        for c in (baseline, other):
            front, dropped = pareto_frontier(c)
            fronts.append(front)
            dominated += [Excluded(c.label, x, y, "dominated: not on the Pareto frontier")
                          for x, y in dropped]
        baseline, other = fronts
    lo = max(baseline.xs[0], other.xs[0])
    hi = min(baseline.xs[-1], other.xs[-1])
    excluded = [Excluded(c.label, x, y, f"outside common range [{lo:g}, {hi:g}]" if lo <= hi else
                         "no common range")
                for c in (baseline, other) for x, y in zip(c.xs, c.ys) if not lo <= x <= hi]
    excluded += dominated
    if lo > hi:
        return Comparison(baseline, other, within_pct, [], excluded, None)
    grid = sorted({x for c in (baseline, other) for x in c.xs if lo <= x <= hi})
    a_vals = interp_monotone(baseline.xs, baseline.ys, grid, log_x=log_x)
    b_vals = interp_monotone(other.xs, other.ys, grid, log_x=log_x)
    points = []
    a_set, b_set = set(baseline.xs), set(other.xs)
    for x, a, b in zip(grid, a_vals, b_vals):
        if a <= 0:
            raise ValueError(f"curve {baseline.label!r}: {baseline.y_metric} = {a:g} at {baseline.x_metric} "
                             f"{x:g}; a ratio needs a positive baseline")
        points.append(PointGap(x, float(a), float(b), x in a_set, x in b_set))
    return Comparison(baseline, other, within_pct, points, excluded, (lo, hi))
