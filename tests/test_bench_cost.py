"""`bench cost`: the $/M-token formula, the shipped price table, the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from openinfer.bench.cost import cost_curve, cost_per_million, load_prices, lookup_price
from openinfer.bench.curves import Curve

EXAMPLE = (Path(__file__).resolve().parents[1] / "benchmarks" / "results"
           / "throughput-llama-246m-fp32-epyc-avx2.json")


def test_formula_matches_a_hand_computed_number():
    # $1.74/h at 1000 tok/s: 3.6M tokens per hour, so 1.74 / 3.6 = $0.48333 per million.
    assert cost_per_million(1000.0, 1.74) == pytest.approx(0.483333333, rel=1e-9)
    assert cost_per_million(2000.0, 1.74) == pytest.approx(cost_per_million(1000.0, 1.74) / 2)
    with pytest.raises(ValueError, match="tok/s/device must be a finite number > 0"):
        cost_per_million(0.0, 1.0)


def test_shipped_prices_hold_the_spec_table():
    devices = load_prices()
    expected = {"H100", "H200", "B200", "GB200", "MI300X", "MI325X", "MI355X", "cpu-2vcpu", "vcpu"}
    assert expected <= set(devices)
    h200 = lookup_price(devices, "H200", "neocloud")
    assert (h200.usd_per_device_hour, h200.kw_per_device) == (1.74, 1.73)
    assert lookup_price(devices, "MI355X", "rental").usd_per_device_hour == 2.10
    assert all(d.get("source") for d in devices.values())  # every price says where it came from
    per_vcpu = lookup_price(devices, "vcpu", vcpus=4)
    assert per_vcpu.usd_per_device_hour == pytest.approx(4 * devices["vcpu"]["usd_per_hour"]["on-demand"])


def test_unknown_device_or_tier_names_the_valid_ones():
    devices = load_prices()
    with pytest.raises(ValueError, match=r"unknown device 'A100'; known devices: H100, H200, .*cpu-2vcpu"):
        lookup_price(devices, "A100", "rental")
    with pytest.raises(ValueError,
                       match="unknown tier 'spot' for device H100; its tiers: hyperscaler, neocloud, rental"):
        lookup_price(devices, "H100", "spot")
    with pytest.raises(ValueError, match="pick one with --tier: hyperscaler, neocloud, rental"):
        lookup_price(devices, "H100")
    with pytest.raises(ValueError, match="priced per vCPU: give --vcpus"):
        lookup_price(devices, "vcpu")


def test_bad_price_file_names_the_file(tmp_path):
    p = tmp_path / "prices.json"
    p.write_text('{"devices": {"X": {"usd_per_hour": {"t": "cheap"}}}}')
    with pytest.raises(ValueError, match=f"{p}: not a price file"):
        load_prices(p)


def test_cost_curve_converts_per_device_throughput_only():
    c = Curve(label="a", xs=[1, 2], ys=[100.0, 400.0], x_metric="batch_size",
              y_metric="output_throughput_per_device")
    usd = cost_curve(c, 3.6)
    assert usd.y_metric == "usd_per_m_output_tokens" and usd.ys == pytest.approx([10.0, 2.5])
    with pytest.raises(ValueError, match="needs a per-device throughput"):
        total = Curve(label="a", xs=[1], ys=[1.0], x_metric="batch_size", y_metric="output_throughput")
        cost_curve(total, 1.0)


def run_cli(*argv):
    from openinfer.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code


def test_cli_cost_on_the_committed_result(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert run_cli("bench", "cost", f"{EXAMPLE}:openinfer", "--device", "H200", "--tier", "rental",
                   "--output-json", str(out)) == 0
    assert "H200 rental $1.6/device-hour" in capsys.readouterr().out
    rep = json.loads(out.read_text())["curves"][0]
    data = json.loads(EXAMPLE.read_text())
    for row, point in zip(rep["points"], data["points"]):
        tps = point["openinfer"]["total_token_throughput_per_device"]
        assert row["batch_size"] == point["batch_size"]
        assert row["usd_per_m_total_tokens"] == pytest.approx(1.60 * 1e6 / (tps * 3600))
        assert row["total_tokens_per_s_per_mw"] == pytest.approx(tps * 1000 / 1.73)
    assert run_cli("bench", "cost", str(EXAMPLE), "--price-per-hour", "0.5") == 0


def test_cli_cost_bad_input_is_one_clear_line(capsys):
    assert run_cli("bench", "cost", str(EXAMPLE), "--device", "TPU") == 2
    assert "unknown device 'TPU'; known devices:" in capsys.readouterr().err
    assert run_cli("bench", "cost", str(EXAMPLE)) == 2
    assert "give --device (one of:" in capsys.readouterr().err
