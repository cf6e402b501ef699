"""``openinfer bench cost``: dollars per million tokens from measured tok/s/device and a $/device-hour price.

InferenceX's cost model (spec 1c): ``$/M tokens = $/device-hour * 1e6 / (tok/s/device * 3600)``, computed
separately for total, input and output throughput; ``tok/s/MW = tok/s/device * 1000 / kW per device``.
Prices come from ``prices.json`` (package data: GPU tiers from the SemiAnalysis TCO table, and CPU VMs), a
``--price-file`` of the same shape, or ``--price-per-hour``.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from openinfer.bench.curves import Curve
from openinfer.bench.result_files import Source, load_sources, to_curve

PRICE_FILE = Path(__file__).with_name("prices.json")
# (throughput field per device, cost key) in table order.
KINDS = (("total_token_throughput_per_device", "total"), ("input_throughput_per_device", "input"),
         ("output_throughput_per_device", "output"))


def cost_per_million(tok_per_s_per_device: float, dollars_per_hour: float) -> float:
    """Dollars per million tokens for one device running at ``tok_per_s_per_device``."""
    if not (tok_per_s_per_device > 0 and math.isfinite(tok_per_s_per_device)):
        raise ValueError(f"tok/s/device must be a finite number > 0, got {tok_per_s_per_device}")
    if not (dollars_per_hour >= 0 and math.isfinite(dollars_per_hour)):
        raise ValueError(f"dollars per hour must be a finite number >= 0, got {dollars_per_hour}")
    return dollars_per_hour * 1e6 / (tok_per_s_per_device * 3600.0)


@dataclass
class Price:
    device: str
    tier: str
    usd_per_device_hour: float
    kw_per_device: float | None
    source: str


def load_prices(path: str | Path | None = None) -> dict[str, dict[str, Any]]:
    p = Path(path) if path else PRICE_FILE
    try:
        data = json.loads(p.read_text())
        devices = data["devices"]
        for name, d in devices.items():
            for tier, v in d["usd_per_hour"].items():
                if not (isinstance(v, (int, float)) and v >= 0):
                    raise ValueError(f"device {name} tier {tier}: price must be a number >= 0, got {v!r}")
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{p}: not a price file ({type(e).__name__}: {e}); expected "
                         f'{{"devices": {{NAME: {{"usd_per_hour": {{TIER: dollars}}}}}}}}') from None
    return devices


def lookup_price(devices: dict[str, dict[str, Any]], device: str, tier: str | None = None,
                 vcpus: int | None = None) -> Price:
    """The $/device-hour of one device and tier. Devices priced per vCPU (``"unit": "vcpu"``) need vcpus:
    the machine the result was measured on is one device made of that many vCPUs."""
    if device not in devices:
        raise ValueError(f"unknown device {device!r}; known devices: {', '.join(devices)}")
    d = devices[device]
    tiers = d["usd_per_hour"]
    if tier is None:
        if len(tiers) != 1:
            raise ValueError(f"device {device} has several price tiers; pick one with --tier: "
                             f"{', '.join(tiers)}")
        tier = next(iter(tiers))
    if tier not in tiers:
        raise ValueError(f"unknown tier {tier!r} for device {device}; its tiers: {', '.join(tiers)}")
    usd = float(tiers[tier])
    source = str(d.get("source", ""))
    if d.get("unit") == "vcpu":
        if not vcpus or vcpus < 1:
            raise ValueError(f"device {device} is priced per vCPU: give --vcpus N (the result file does not "
                             f"record a cpu_count)")
        source = f"{source} (x {vcpus} vCPUs)"
        usd *= vcpus
    return Price(device, tier, usd, d.get("kw_per_device"), source)


def cost_curve(curve: Curve, dollars_per_hour: float) -> Curve:
    """The same points with y turned into $/M tokens (lower is better); the throughput must be per device."""
    if not curve.y_metric.endswith("_per_device"):
        raise ValueError(f"curve {curve.label!r}: cost needs a per-device throughput, got {curve.y_metric!r}")
    name = curve.y_metric.removesuffix("_per_device").replace("_throughput", "").replace("_token", "")
    return Curve(label=curve.label, xs=list(curve.xs),
                 ys=[cost_per_million(y, dollars_per_hour) for y in curve.ys],
                 x_metric=curve.x_metric, y_metric=f"usd_per_m_{name}_tokens",
                 meta=dict(curve.meta, usd_per_device_hour=dollars_per_hour),
                 read_off_chart=curve.read_off_chart)


def cost_table(src: Source, x_metric: str, price: Price) -> list[dict[str, Any]]:
    """One row per point: x, the three per-device throughputs and their $/M tokens (None where the source
    lacks that throughput), tok/s/MW when the device's power is known."""
    rows: dict[float, dict[str, Any]] = {}
    for field, kind in KINDS:
        if not all(field in p for p in src.points):
            continue
        tput = to_curve(src, x_metric, field)
        usd = cost_curve(tput, price.usd_per_device_hour)
        for x, t, c in zip(tput.xs, tput.ys, usd.ys):
            row = rows.setdefault(x, {x_metric: x})
            row[field] = t
            row[f"usd_per_m_{kind}_tokens"] = c
            if price.kw_per_device:
                row[f"{kind}_tokens_per_s_per_mw"] = t * 1000.0 / price.kw_per_device
    if not rows:
        raise ValueError(f"{', '.join(src.files)}: {src.label!r} has no per-device throughput; record the "
                         f"device count (bench serve --metadata num_devices=N, or '# num_devices: N' in a "
                         f"CSV)")
    return [rows[x] for x in sorted(rows)]


# -- CLI --------------------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", metavar="RESULT", help="result files (FILE:engine picks one engine)")
    p.add_argument("--device", default=None,
                   help="priced device in the price file, e.g. H200, cpu-2vcpu, vcpu")
    p.add_argument("--tier", default=None, help="price tier, e.g. hyperscaler, neocloud, rental, on-demand")
    p.add_argument("--price-file", default=None, help=f"JSON price table (default: {PRICE_FILE.name} shipped "
                                                      f"with openinfer)")
    p.add_argument("--price-per-hour", type=float, default=None, help="$/device-hour, instead of --device")
    p.add_argument("--vcpus", type=int, default=None, help="vCPUs per device for per-vCPU prices")
    p.add_argument("--x", default=None, help="x field (default: batch_size, else concurrency)")
    p.add_argument("--output-json", default=None)


def _price_from_args(args: argparse.Namespace, src: Source) -> Price:
    if args.price_per_hour is not None:
        if args.device or args.tier:
            raise ValueError("give either --price-per-hour or --device/--tier, not both")
        if not (args.price_per_hour >= 0 and math.isfinite(args.price_per_hour)):
            raise ValueError(f"--price-per-hour must be a finite number >= 0, got {args.price_per_hour}")
        return Price("custom", "custom", args.price_per_hour, None, "--price-per-hour")
    devices = load_prices(args.price_file)
    if not args.device:
        raise ValueError(f"give --device (one of: {', '.join(devices)}) or --price-per-hour")
    if args.vcpus is not None and args.vcpus < 1:
        raise ValueError(f"--vcpus must be >= 1, got {args.vcpus}")
    return lookup_price(devices, args.device, args.tier, args.vcpus or src.meta.get("cpu_count"))


def _x_metric(args: argparse.Namespace, src: Source) -> str:
    if args.x:
        return args.x
    for m in ("batch_size", "concurrency"):
        if all(m in p for p in src.points):
            return m
    return next(iter(src.points[0]))  # a chart CSV: its own x axis comes first


def main(args: argparse.Namespace) -> int:
    sources = load_sources(args.results)
    report = []
    for src in sources:
        price = _price_from_args(args, src)
        x = _x_metric(args, src)
        rows = cost_table(src, x, price)
        report.append({"label": src.label, "files": src.files, "read_off_chart": src.read_off_chart,
                       "x_metric": x, "price": asdict(price), "points": rows})
        _print(src, x, price, rows)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"formula": "usd_per_hour * 1e6 / (tok_per_s_per_device "
                                                                 "* 3600)", "curves": report}, indent=2))
        print(f"wrote {args.output_json}")
    return 0


def _print(src: Source, x: str, price: Price, rows: list[dict[str, Any]]) -> None:
    chart = ", read off a chart" if src.read_off_chart else ""
    print(f"\n{src.label} ({', '.join(src.files)}{chart}): {price.device} {price.tier} "
          f"${price.usd_per_device_hour:.4g}/device-hour")
    head = (f"{x:>14} | {'tok/s/dev total':>15} {'input':>9} {'output':>9} | {'$/M total':>10} "
            f"{'input':>10} {'output':>10}")
    print(head)
    print("-" * len(head))

    def f(v: float | None, w: int, spec: str) -> str:
        return f"{v:>{w}{spec}}" if v is not None else f"{'-':>{w}}"

    for r in rows:
        print(f"{r[x]:>14g} | {f(r.get(KINDS[0][0]), 15, '.2f')} {f(r.get(KINDS[1][0]), 9, '.2f')} "
              f"{f(r.get(KINDS[2][0]), 9, '.2f')} | {f(r.get('usd_per_m_total_tokens'), 10, '.3f')} "
              f"{f(r.get('usd_per_m_input_tokens'), 10, '.3f')} "
              f"{f(r.get('usd_per_m_output_tokens'), 10, '.3f')}")
    print(f"price source: {price.source}")
    print("each $/M column bills the whole device-hour to that kind of token (InferenceX convention), "
          "so the columns do not add up")
