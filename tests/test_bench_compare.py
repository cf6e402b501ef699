"""`bench compare`: gap math on known curves, monotone interpolation, the three input formats, the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from openinfer.bench.curves import Curve, compare_curves, interp_monotone, pareto_frontier
from openinfer.bench.result_files import load_curves, load_sources

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "benchmarks" / "results" / "throughput-llama-246m-fp32-epyc-avx2.json"


def curve(label, xs, ys, **kw):
    return Curve(label=label, xs=xs, ys=ys, x_metric=kw.pop("x_metric", "batch_size"),
                 y_metric=kw.pop("y_metric", "output_throughput"), **kw)


A = curve("A", [8, 16, 32, 64, 128, 256], [100, 180, 300, 450, 560, 600])


# -- gap math ---------------------------------------------------------------------------------------


def test_identical_curves_have_zero_gap():
    cmp = compare_curves(A, curve("B", A.xs, A.ys), 6)
    assert cmp.max_gap_pct == 0 and cmp.mean_gap_pct == 0
    assert cmp.within is True and not cmp.excluded
    assert [p.ratio for p in cmp.points] == [1.0] * 6


def test_uniformly_5pct_slower_is_within_6_not_within_4():
    b = curve("B", A.xs, [0.95 * y for y in A.ys])
    six = compare_curves(A, b, 6)
    assert six.max_gap_pct == pytest.approx(5.0) and six.mean_gap_pct == pytest.approx(5.0)
    assert six.within is True and "B is within 6% of A" in six.verdict()
    four = compare_curves(A, b, 4)
    assert four.within is False and "NOT within 4%" in four.verdict()


def test_one_bad_point_decides_the_verdict():
    ys = [y * 1.01 for y in A.ys]
    ys[3] = A.ys[3] * 0.90  # a 10% dip at one batch size
    cmp = compare_curves(A, curve("B", A.xs, ys), 6)
    assert cmp.max_gap_pct == pytest.approx(10.0) and cmp.within is False
    assert cmp.mean_gap_pct == pytest.approx((5 * 1 + 10) / 6)


def test_mismatched_grids_are_interpolated_at_the_union():
    # B measured only at 8, 32, 128 and exactly 5% below A there; at 16 and 64 A is measured and B is
    # interpolated between its own neighbours.
    b = curve("B", [8, 32, 128], [95, 285, 532])
    cmp = compare_curves(A, b, 6)
    assert [p.x for p in cmp.points] == [8, 16, 32, 64, 128]
    by_x = {p.x: p for p in cmp.points}
    assert by_x[32].a_measured and by_x[32].b_measured and by_x[32].gap_pct == pytest.approx(5.0)
    assert by_x[16].a_measured and not by_x[16].b_measured
    lo, hi = 95, 285  # B's interpolated value lies between its measured neighbours
    assert lo < by_x[16].b < hi
    assert by_x[16].b == pytest.approx(float(interp_monotone(b.xs, b.ys, 16, log_x=True)[0]))


def test_points_outside_the_common_range_are_excluded_and_reported():
    b = curve("B", [2, 4, 16, 64], [30, 60, 171, 427.5])
    cmp = compare_curves(A, b, 6)
    assert cmp.common_range == (8, 64)
    assert all(8 <= p.x <= 64 for p in cmp.points)
    excluded = {(e.label, e.x) for e in cmp.excluded}
    assert excluded == {("B", 2), ("B", 4), ("A", 128), ("A", 256)}
    assert "4 excluded" in cmp.verdict()


def test_disjoint_curves_get_no_verdict():
    cmp = compare_curves(A, curve("B", [512, 1024], [1, 2]), 6)
    assert cmp.within is None and not cmp.points and len(cmp.excluded) == 8
    assert "no common batch_size range" in cmp.verdict()


def test_compare_rejects_mismatched_metrics_and_bad_within():
    with pytest.raises(ValueError, match="different things"):
        compare_curves(A, curve("B", A.xs, A.ys, y_metric="total_token_throughput"), 6)
    with pytest.raises(ValueError, match="within must be a finite percentage > 0"):
        compare_curves(A, A, 0)


# -- interpolation ----------------------------------------------------------------------------------


def test_monotone_interpolation_never_overshoots_a_step():
    xs = [0, 1, 2, 3, 4, 5]
    ys = [0, 0, 0, 1, 1, 1]
    q = np.linspace(0, 5, 501)
    v = interp_monotone(xs, ys, q)
    assert v.min() >= 0 and v.max() <= 1
    assert np.all(np.diff(v) >= -1e-12)  # monotone data stays monotone
    assert np.all(v[q <= 2] == 0) and np.all(v[q >= 3] == 1)  # flat parts stay flat


def test_interpolation_stays_between_neighbours_on_a_peaked_curve():
    xs = [1, 2, 4, 8, 16, 32]
    ys = [10, 50, 55, 120, 60, 61]
    for log_x in (False, True):
        for i in range(len(xs) - 1):
            q = np.linspace(xs[i], xs[i + 1], 50)
            v = interp_monotone(xs, ys, q, log_x=log_x)
            assert min(ys[i], ys[i + 1]) - 1e-9 <= v.min() and v.max() <= max(ys[i], ys[i + 1]) + 1e-9
    assert list(interp_monotone(xs, ys, xs)) == ys  # exact at the nodes


def test_interpolation_refuses_to_extrapolate():
    with pytest.raises(ValueError, match="outside the measured range"):
        interp_monotone([1, 2, 3], [1, 2, 3], 3.5)


def test_pareto_frontier_drops_dominated_points():
    c = curve("S", [10, 20, 30, 40], [500, 300, 350, 100], x_metric="interactivity")
    front, dropped = pareto_frontier(c)
    assert front.xs == [10, 30, 40] and dropped == [(20, 300)]
    cmp = compare_curves(front, c, 6)
    assert any("Pareto" in e.reason for e in cmp.excluded)


def test_curve_validates_its_points():
    with pytest.raises(ValueError, match="appears twice"):
        curve("C", [1, 1], [2, 3])
    with pytest.raises(ValueError, match="2 x values but 1 y values"):
        curve("C", [1, 2], [3])


# -- loaders ----------------------------------------------------------------------------------------


def test_committed_throughput_json_gives_one_curve_per_engine():
    curves = load_curves([str(EXAMPLE)], "batch_size", "output_throughput")
    data = json.loads(EXAMPLE.read_text())
    assert [c.label for c in curves] == ["openinfer", "hf"]
    oi = curves[0]
    assert oi.xs == [1, 8, 32]
    assert oi.ys == [p["openinfer"]["output_throughput"] for p in data["points"]]
    assert oi.meta["hardware"].startswith("AMD EPYC") and oi.meta["dtype"] == "float32"
    assert not oi.read_off_chart
    (hf,) = load_curves([f"{EXAMPLE}:hf"], "batch_size", "output_throughput_per_device")
    assert hf.label == "hf" and hf.ys[0] == data["points"][0]["hf"]["output_throughput_per_device"]
    with pytest.raises(ValueError, match="no engine 'vllm'; engines with points: openinfer, hf"):
        load_curves([f"{EXAMPLE}:vllm"], "batch_size", "output_throughput")


def serve_file(tmp_path, conc, out_tps, tpot_ms, label="vllm", **extra):
    d = {"date": "20260101-000000", "backend": "vllm", "label": label, "model_id": "m",
         "max_concurrency": conc,
         "output_throughput": out_tps, "total_token_throughput": 2 * out_tps, "median_tpot_ms": tpot_ms,
         "p90_itl_ms": 2 * tpot_ms, "completed": 10, **extra}
    p = tmp_path / f"{label}-c{conc}.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_serve_sweep_files_form_one_curve(tmp_path):
    files = [serve_file(tmp_path, c, 10.0 * c, 5.0 * c, num_devices="2") for c in (4, 1, 16)]
    files.append(serve_file(tmp_path, 4, 30.0, 20.0, label="sglang"))
    vllm, sglang = load_curves(files, "concurrency", "output_throughput")
    assert (vllm.label, sglang.label) == ("vllm", "sglang")
    assert vllm.xs == [1, 4, 16] and vllm.ys == [10.0, 40.0, 160.0] and sglang.xs == [4]
    (per_dev,) = load_curves(files[:3], "concurrency", "output_throughput_per_device")
    assert per_dev.ys == [5.0, 20.0, 80.0]
    # sglang's file does not say how many devices it ran on, so there is no per-device number to give.
    with pytest.raises(ValueError, match="sglang-c4.json: 'sglang' has no field 'output_throughput_per_dev"):
        load_curves(files, "concurrency", "output_throughput_per_device")
    (c,) = load_curves(files[:3], "interactivity", "output_throughput")
    assert c.xs == [1000 / 80, 1000 / 20, 1000 / 5]
    (p90,) = load_curves(files[:3], "interactivity", "output_throughput", interactivity="p90-itl")
    assert p90.xs == [1000 / 160, 1000 / 40, 1000 / 10]


def test_any_numeric_field_can_be_an_axis(tmp_path):
    files = [serve_file(tmp_path, c, 10.0 * c, 5.0, p90_interactivity=100.0 / c,
                        total_token_throughput_per_device=7.0 * c) for c in (1, 2)]
    (c,) = load_curves(files, "p90_interactivity", "total_token_throughput_per_device")
    assert c.xs == [50.0, 100.0] and c.ys == [14.0, 7.0]


def chart_csv(tmp_path, rows, **meta):
    meta = {"label": "DeepInfer README", "source": "https://example.org/chart.png", "hardware": "64x SM100",
            "x_metric": "batch_size", "y_metric": "output_throughput_per_device", "num_devices": "64", **meta}
    text = "".join(f"# {k}: {v}\n" for k, v in meta.items()) + "x,y\n"
    text += "".join(f"{x},{y}\n" for x, y in rows)
    p = tmp_path / "chart.csv"
    p.write_text(text)
    return str(p)


def test_chart_csv_is_marked_read_off_chart(tmp_path):
    (c,) = load_curves([chart_csv(tmp_path, [(8, 100), (64, 400)])], "batch_size", "output_throughput")
    assert c.read_off_chart and c.label == "DeepInfer README"
    assert c.ys == [6400, 25600]  # per-device x 64 devices
    assert c.meta["source_url"] == "https://example.org/chart.png"
    run = curve("run", [8, 64], [6000, 25000])
    verdict = compare_curves(c, run, 6).verdict()
    assert "DeepInfer README read off a published chart, not measured" in verdict


@pytest.mark.parametrize("content, match", [
    ("{not json", "not readable JSON"),
    ('{"schema": "other"}', "not a result file this tool reads"),
    ('{"schema": "openinfer.bench.throughput/v1", "points": []}', "has no points"),
])
def test_bad_json_files_name_the_file(tmp_path, content, match):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(ValueError, match=match) as e:
        load_sources([str(p)])
    assert str(p) in str(e.value)


def test_bad_csv_and_missing_files_name_the_file(tmp_path):
    p = chart_csv(tmp_path, [(8, 100), (16, "abc")])
    with pytest.raises(ValueError, match=r"chart.csv:\d+: expected two numbers"):
        load_sources([p])
    no_axes = tmp_path / "noaxes.csv"
    no_axes.write_text("x,y\n1,2\n")
    with pytest.raises(ValueError, match="noaxes.csv: say what the axes are"):
        load_sources([str(no_axes)])
    with pytest.raises(ValueError, match="missing.json: no such file"):
        load_sources([str(tmp_path / "missing.json")])


# -- CLI end to end ---------------------------------------------------------------------------------


def run_cli(*argv):
    from openinfer.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code


def test_cli_compare_writes_json_and_png(tmp_path, capsys):
    import matplotlib.image

    chart = chart_csv(tmp_path, [(4, 8.0), (16, 30.0), (64, 60.0)], num_devices="1",
                      y_metric="output_throughput")
    out_json, out_png = tmp_path / "cmp.json", tmp_path / "cmp.png"
    rc = run_cli("bench", "compare", f"{EXAMPLE}:hf", f"{EXAMPLE}:openinfer", chart, "--within", "6",
                 "--output-json", str(out_json), "--plot", str(out_png))
    assert rc == 0
    out = capsys.readouterr().out
    assert "Conditions" in out and "verdict: openinfer is NOT within 6% of hf" in out
    rep = json.loads(out_json.read_text())
    first, second = rep["comparisons"]
    assert first["baseline"] == "hf" and first["within"] is False
    data = json.loads(EXAMPLE.read_text())
    assert first["points"][2]["ratio"] == pytest.approx(
        data["points"][2]["openinfer"]["output_throughput"] / data["points"][2]["hf"]["output_throughput"])
    assert second["read_off_chart"] == ["DeepInfer README"]
    assert {(e["curve"], e["x"]) for e in second["excluded"]} == {("hf", 1), ("DeepInfer README", 64)}
    assert "hardware" in second["conditions_differ"]
    img = matplotlib.image.imread(out_png)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200


def test_cli_compare_bad_input_is_one_clear_line(tmp_path, capsys):
    assert run_cli("bench", "compare", str(EXAMPLE), "--baseline", "nope") == 2
    assert "--baseline 'nope' is not a curve; curves: openinfer, hf" in capsys.readouterr().err
    assert run_cli("bench", "compare", f"{EXAMPLE}:hf") == 2
    assert "compare needs at least two curves" in capsys.readouterr().err
    assert run_cli("bench", "compare", str(EXAMPLE), "--within", "-1") == 2
    assert "--within: must be a finite percentage > 0" in capsys.readouterr().err


# -- plots used by other commands -------------------------------------------------------------------


def test_plot_functions_write_valid_pngs(tmp_path):
    import matplotlib.image

    from openinfer.bench.plots import plot_pareto, plot_throughput_vs_batch, provenance_caption

    chart = curve("chart", [8, 64], [90.0, 500.0], read_off_chart=True,
                  meta={"source_url": "https://x/y.png"})
    caption = provenance_caption([A, chart])
    assert "chart: read off chart https://x/y.png" in caption and "A: measured by ?" in caption
    p1 = plot_throughput_vs_batch([A, chart], tmp_path / "tput.png", y_label="output tok/s", caption=caption)
    sweep = curve("s", [10, 20, 30, 40], [500, 300, 350, 100], x_metric="interactivity",
                  y_metric="total_token_throughput_per_device")
    p2 = plot_pareto([sweep], tmp_path / "sub" / "pareto.png", caption="measured here")
    for p in (p1, p2):
        img = matplotlib.image.imread(p)
        assert img.ndim == 3 and min(img.shape[:2]) > 200
    with pytest.raises(ValueError, match="no curves"):
        plot_pareto([], tmp_path / "empty.png", caption="")
