"""scripts/dep32_projection.py: its figures against hand computations from V4-Flash's config (spec §2, §5).
Pure arithmetic, no torch model built (the openinfer KV figures come from kv_bytes_report, tested elsewhere)."""
from __future__ import annotations

import importlib.util
import sys
from math import comb
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def proj():
    spec = importlib.util.spec_from_file_location("dep32_projection", ROOT / "scripts" / "dep32_projection.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def test_dispatch_combine_bytes_by_hand(proj):
    cfg = proj.V4_FLASH
    # fp8: 4096 values + 32 fp32 scales (one per 128); bf16 combine: 2 bytes x 4096
    assert proj.dispatch_bytes_per_copy(cfg["hidden_size"], "fp8") == 4096 + 32 * 4 == 4224
    assert proj.combine_bytes_per_copy(cfg["hidden_size"]) == 8192
    with pytest.raises(ValueError, match="dispatch format"):
        proj.dispatch_bytes_per_copy(4096, "fp4")
    # batch 8, nextn 3: 32 verified tokens x 43 layers + MTP (32 + 2 x 8) tokens x 1 layer = 1424 passes,
    # each sending 6 x 31/32 remote copies
    a = proj.all_to_all(cfg, proj.Shape(), 8)
    assert a.moe_layer_passes == 32 * 43 + 48 == 1424
    assert a.dispatch_mb_fp8 == pytest.approx(1424 * 6 * 31 / 32 * 4224 / 1e6)
    assert a.link_ms_fp8 == pytest.approx((a.dispatch_mb_fp8 + a.combine_mb) / 900)
    # 6 of 256 experts on 32 ranks of 8: 1 - P(no expert on a given rank)
    assert proj.expected_ranks(256, 6, 32) == pytest.approx(32 * (1 - comb(248, 6) / comb(256, 6)))
    assert proj.expected_ranks(256, 1, 32) == pytest.approx(1.0)


def test_kv_bytes_and_reads_by_hand(proj):
    cfg = proj.V4_FLASH
    vl = proj.vllm_fp8_ds_mla_kv(cfg)
    # 21 CSA layers: (584 + 132) / 4; 20 HCA layers: 584 / 128  (spec §5: ~3.85 KB/token)
    assert vl["bytes_per_token"] == pytest.approx(21 * 716 / 4 + 20 * 584 / 128) == 3850.25
    assert vl["ring_bytes_per_seq"] == 43 * 128 * 584
    r = proj.attention_read_bytes(cfg, 131072)
    assert r["indexer_keys"] == 21 * 32768 * 132 and r["csa_topk"] == 21 * 512 * 584
    assert r["hca_entries"] == 20 * 1024 * 584
    # the flat part (window + top-k) does not change with context; the indexer and HCA scale with it
    r4 = proj.attention_read_bytes(cfg, 4096)
    assert (r4["window"], r4["csa_topk"]) == (r["window"], r["csa_topk"])
    assert r["indexer_keys"] == 32 * r4["indexer_keys"]
