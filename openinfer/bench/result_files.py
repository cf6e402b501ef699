"""Read benchmark result files into ``Curve`` objects.

Three inputs, detected by content:

* ``openinfer bench throughput`` JSON (schema ``openinfer.bench.throughput/v1``): one curve per engine in the
  file (``FILE:engine`` picks one); x = ``batch_size``.
* ``bench serve`` JSON, openinfer's or vLLM's (same field names): one file is one point; files sharing a
  (label or backend, model_id) form one curve, e.g. a concurrency sweep; x = ``concurrency``.
* CSV of points read off a published chart: ``x,y`` rows after ``# key: value`` comment lines (label, source,
  hardware, x_metric, y_metric, num_devices ...). Such curves are ``read_off_chart``.

Every numeric field of a point can be an axis (so ``--x p90_interactivity`` works once results carry it), plus
derived fields: ``*_per_device`` twins, ``input_throughput`` and ``interactivity`` (tok/s/user).
"""
from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openinfer.bench.curves import Curve

THROUGHPUT_SCHEMA = "openinfer.bench.throughput/v1"  # == results.SCHEMA; not imported to keep torch out
_RATES = ("output_throughput", "total_token_throughput", "input_throughput", "requests_per_second",
          "request_throughput")
INTERACTIVITY_SOURCES = {"median-tpot": "median_tpot_ms", "p90-itl": "p90_itl_ms"}


@dataclass
class Source:
    """Points sharing one provenance: one engine of a throughput file, one serve sweep, one chart CSV."""

    label: str
    points: list[dict[str, float]]
    meta: dict[str, Any]
    read_off_chart: bool = False
    files: list[str] = field(default_factory=list)


# -- public entry points ----------------------------------------------------------------------------


def load_sources(specs: list[str], *, interactivity: str = "median-tpot") -> list[Source]:
    """Each spec is a path, or ``PATH:engine`` for one engine of a throughput file. Serve files with the same
    (label, model_id) merge into one source, in the order first seen."""
    if interactivity not in INTERACTIVITY_SOURCES:
        raise ValueError(f"interactivity must be one of {', '.join(INTERACTIVITY_SOURCES)}, "
                         f"got {interactivity!r}")
    out: list[Source] = []
    serve_groups: dict[tuple[str, str], Source] = {}
    for spec in specs:
        path, engine = _split_spec(spec)
        if path.suffix.lower() == ".csv":
            _reject_engine(path, engine)
            out.append(_chart_csv(path))
            continue
        data = _read_json(path)
        if data.get("schema") == THROUGHPUT_SCHEMA:
            out.extend(_throughput(path, data, engine))
        elif "output_throughput" in data and ("max_concurrency" in data or "backend" in data):
            _reject_engine(path, engine)
            src = _serve(path, data, interactivity)
            key = (src.label, str(src.meta.get("model")))
            if key in serve_groups:
                _merge(serve_groups[key], src)
            else:
                serve_groups[key] = src
                out.append(src)
        else:
            raise ValueError(f"{path}: not a result file this tool reads (expected schema "
                             f"{THROUGHPUT_SCHEMA!r}, a bench serve JSON with output_throughput and "
                             f"max_concurrency, or a .csv)")
    labels = [s.label for s in out]
    for s in out:  # same label from two files: tell them apart by file name
        if labels.count(s.label) > 1:
            s.label = f"{s.label} ({Path(s.files[0]).stem})"
    return out


def to_curve(src: Source, x_metric: str, y_metric: str) -> Curve:
    """The (x_metric, y_metric) view of a source. Repeated x values (repeat runs) are merged by median."""
    by_x: dict[float, list[float]] = {}
    for p in src.points:
        for m in (x_metric, y_metric):
            if m not in p:
                avail = sorted({k for q in src.points for k in q})
                raise ValueError(f"{', '.join(src.files)}: {src.label!r} has no field {m!r}; "
                                 f"numeric fields there: {', '.join(avail)}")
        by_x.setdefault(p[x_metric], []).append(p[y_metric])
    meta = dict(src.meta, files=list(src.files))
    repeats = max(len(v) for v in by_x.values())
    if repeats > 1:
        meta["repeats"] = f"up to {repeats} runs per x, median taken"
    xs = sorted(by_x)
    return Curve(label=src.label, xs=xs, ys=[statistics.median(by_x[x]) for x in xs], x_metric=x_metric,
                 y_metric=y_metric, meta=meta, read_off_chart=src.read_off_chart)


def load_curves(specs: list[str], x_metric: str, y_metric: str, *,
                interactivity: str = "median-tpot") -> list[Curve]:
    return [to_curve(s, x_metric, y_metric) for s in load_sources(specs, interactivity=interactivity)]


# -- helpers ----------------------------------------------------------------------------------------


def _split_spec(spec: str) -> tuple[Path, str | None]:
    p = Path(spec)
    if not p.exists() and ":" in spec:
        head, engine = spec.rsplit(":", 1)
        p = Path(head)
        if not p.exists():
            raise ValueError(f"{head}: no such file")
        return p, engine
    if not p.is_file():
        raise ValueError(f"{spec}: no such file")
    return p, None


def _reject_engine(path: Path, engine: str | None) -> None:
    if engine is not None:
        raise ValueError(f"{path}:{engine}: only throughput files hold several engines; drop ':{engine}'")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top, got {type(data).__name__}")
    return data


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, str):  # bench serve --metadata stores KEY=VALUE as strings
        try:
            v = float(v)
        except ValueError:
            return None
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def numeric_fields(d: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in d.items():
        n = _number(v)
        if n is not None:
            out[k] = n
    return out


def _derive(p: dict[str, float]) -> dict[str, float]:
    """Add the derived fields a chart may ask for, never overwriting a field the file already has."""
    if "input_throughput" not in p and "total_token_throughput" in p and "output_throughput" in p:
        p["input_throughput"] = p["total_token_throughput"] - p["output_throughput"]
    n = p.get("num_devices")
    if n:
        for k in _RATES:
            if k in p:
                p.setdefault(f"{k}_per_device", p[k] / n)
            elif f"{k}_per_device" in p:
                p[k] = p[f"{k}_per_device"] * n
    return p


def _parallel(d: dict[str, Any], num_devices: Any) -> str | None:
    names = (("tp", ("tp", "tensor_parallel_size")), ("pp", ("pp", "pipeline_parallel_size")),
             ("ep", ("ep", "expert_parallel_size")), ("dp", ("dp", "data_parallel_size")))
    parts = []
    for short, keys in names:
        v = next((d[k] for k in keys if d.get(k) not in (None, "")), None)
        if v is not None:
            parts.append(f"{short}{v}")
    if parts:
        return " ".join(parts)
    if d.get("parallel"):
        return str(d["parallel"])
    return "none (1 device)" if _number(num_devices) == 1 else None


def _merge(into: Source, src: Source) -> None:
    into.points.extend(src.points)
    into.files.extend(src.files)
    for k, v in src.meta.items():  # a sweep whose files disagree on provenance says so instead of hiding it
        old = into.meta.get(k)
        if old != v and k not in ("date", "command"):
            into.meta[k] = f"mixed: {old} / {v}"


# -- the three formats ------------------------------------------------------------------------------


def _throughput(path: Path, data: dict[str, Any], engine: str | None) -> list[Source]:
    engines = data.get("engines") or {}
    points = data.get("points")
    if not isinstance(points, list) or not points:
        raise ValueError(f"{path}: throughput file has no points")
    present = [e for e in engines if any(isinstance(p.get(e), dict) for p in points)]
    if engine is not None and engine not in present:
        raise ValueError(f"{path}: no engine {engine!r}; engines with points: {', '.join(present) or 'none'}")
    env = data.get("environment") or {}
    wl = data.get("workload") or {}
    model = env.get("model") or {}
    out = []
    for name in [engine] if engine else present:
        eng = engines.get(name) or {}
        pts = []
        for row in points:
            s = row.get(name)
            if not isinstance(s, dict):
                continue
            p = numeric_fields(s)
            if "batch_size" not in p:
                raise ValueError(f"{path}: a {name} point has no batch_size")
            # Offline: batch size = requests in flight, so it doubles as concurrency; per-user rate is the
            # batch's output rate shared by its requests (vLLM `bench sweep plot_pareto` definition; prefill
            # time included, so it understates decode-only interactivity).
            p.setdefault("concurrency", p["batch_size"])
            if "output_throughput" in p:
                p.setdefault("interactivity", p["output_throughput"] / p["batch_size"])
            pts.append(_derive(p))
        hw = env.get("device_name") or env.get("cpu_model")
        if hw and not env.get("device_name") and env.get("cpu_flags") is not None:
            hw = f"{hw} ({'+'.join(env['cpu_flags']) or 'no avx2'}, {env.get('cpu_count', '?')} cpus)"
        n_dev = env.get("num_devices")
        meta = {
            "hardware": hw,
            "device": env.get("device"),
            "num_devices": n_dev,
            "parallel": _parallel(eng, n_dev),
            "model": _model_name(model),
            "dtype": eng.get("dtype"),
            "input_len": wl.get("input_len"),
            "output_len": wl.get("output_len"),
            "context_len": eng.get("max_model_len"),
            # `bench throughput` has no speculative-decoding option, so an unstated value means none.
            "spec_decoding": eng.get("spec_decoding", "none"),
            "measured_by": data.get("measured_by") or "openinfer bench throughput",
            "runner": eng.get("runner", name),
            "date": data.get("date"),
            "command": _command(data.get("command")),
            "cpu_count": env.get("cpu_count") if env.get("device") == "cpu" else None,
        }
        out.append(Source(label=name, points=pts, meta=meta, files=[str(path)]))
    return out


def _command(argv: Any) -> str | None:
    if not argv:
        return None
    argv = [str(a) for a in argv]
    if argv[0].endswith(("__main__.py", "/openinfer")):  # the interpreter's view of `openinfer ...`
        argv[0] = "openinfer"
    return " ".join(argv)


def _model_name(model: dict[str, Any]) -> str | None:
    if not model:
        return None
    name = model.get("architecture") or Path(str(model.get("path", "?"))).name
    n = model.get("num_params")
    return f"{name} {n / 1e6:.0f}M" if n else name


def _serve(path: Path, data: dict[str, Any], interactivity: str) -> Source:
    p = numeric_fields(data)
    if "max_concurrency" in p:
        p.setdefault("concurrency", p["max_concurrency"])
    src_key = INTERACTIVITY_SOURCES[interactivity]
    if p.get(src_key, 0) > 0:
        p.setdefault("interactivity", 1000.0 / p[src_key])  # InferenceX: intvty = 1000 / tpot_ms (tok/s/user)
    if p.get("p90_itl_ms", 0) > 0:
        p.setdefault("p90_interactivity", 1000.0 / p["p90_itl_ms"])  # AgentX: p90 intvty = 1 / p90 ITL
    if "num_devices" not in p and "tp" in p:
        p["num_devices"] = p["tp"] * p.get("pp", 1) * p.get("dp", 1)
    label = str(data.get("label") or data.get("backend") or path.stem)
    meta = {
        "hardware": _first(data, "hardware", "hw", "gpu", "device_name"),
        "device": data.get("device"),
        "num_devices": _fmt_num(p.get("num_devices")),
        "parallel": _parallel(data, p.get("num_devices")),
        "model": data.get("model_id"),
        "dtype": _first(data, "dtype", "precision"),
        "input_len": data.get("random_input_len"),
        "output_len": data.get("random_output_len"),
        "context_len": _first(data, "context_len", "max_model_len"),
        "spec_decoding": data.get("spec_decoding"),
        "measured_by": data.get("measured_by"),
        "date": data.get("date"),
    }
    return Source(label=label, points=[_derive(p)], meta=meta, files=[str(path)])


def _first(d: dict[str, Any], *keys: str) -> Any:
    return next((d[k] for k in keys if d.get(k) not in (None, "")), None)


def _fmt_num(v: float | None) -> Any:
    return int(v) if v is not None and v == int(v) else v


def _chart_csv(path: Path) -> Source:
    meta: dict[str, Any] = {}
    rows: list[list[str]] = []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not readable ({e})") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s:
            continue
        if s.startswith("#"):
            key, sep, value = s[1:].partition(":")
            if sep and key.strip():
                meta[key.strip().lower()] = value.strip()
            continue
        rows.append(next(csv.reader([s])))
        rows[-1].append(str(lineno))
    if not rows or [c.strip().lower() for c in rows[0][:-1]] != ["x", "y"]:
        raise ValueError(f"{path}: a chart CSV needs a header row 'x,y' after its '# key: value' lines")
    x_metric = meta.pop("x_metric", None)
    y_metric = meta.pop("y_metric", None)
    if not x_metric or not y_metric:
        raise ValueError(f"{path}: say what the axes are with '# x_metric: ...' and '# y_metric: ...' "
                         f"(e.g. batch_size, output_throughput_per_device)")
    n_dev = _number(meta.get("num_devices"))
    points = []
    for row in rows[1:]:
        lineno = row.pop()
        vals = [_number(c.strip()) for c in row]
        if len(vals) != 2 or None in vals:
            raise ValueError(f"{path}:{lineno}: expected two numbers 'x,y', got {','.join(row)!r}")
        p = {x_metric: vals[0], y_metric: vals[1]}
        if n_dev:
            p["num_devices"] = n_dev
        points.append(_derive(p))
    if not points:
        raise ValueError(f"{path}: no data rows")
    meta["source_url"] = meta.pop("source", None)
    label = meta.pop("label", None) or path.stem
    return Source(label=label, points=points, meta=meta, read_off_chart=True, files=[str(path)])
