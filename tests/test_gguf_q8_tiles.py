"""The GGUF int8 prefill kernel (cpu_kernels/gguf_q8_tiles.cpp, from ``GGUF_TILE_ROWS`` activation rows with int8
activations): weight chunks of 16 rows decoded once into an int8 tile, integer dots over every activation row.
The same arithmetic as the small-M int8 kernel, so the same checks as test_gguf_q8.py, at M = 24..300:
- bit for bit with unit scales and integer activations (every partial sum an exact integer in fp32);
- against ``matmul_q8_reference`` within the fp32 rounding bound of test_gguf_q8.py, N not a multiple of the
  16-column chunk, every remainder of the row pass, K one block and several, a bias, an all-zero activation block;
- a corrupted scale byte leaves the bound in exactly that output column (the check can fail);
- full 16-column chunks (decoded 8 weight rows at a time, transposed in registers) give the bits of the same rows
  decoded one by one (a chunk of 15: the tail path);
- the small-M int8 entry (``gguf_linear_q8``) hands its calls from ``gguf_q8_tile_from`` rows on to this kernel.
test_avx2_variant.py reruns this file on the x86-64-v3 build (AVX2 maddubs, no VNNI: Q8_0 without tiles).
"""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import quants as gq
from test_gguf_q8 import _integer_x, _q8_bound, _unit_scale_blocks
from test_gguf_quant import _blocks

from openinfer.layers import gguf_quant
from openinfer.layers.gguf_quant import GGUF_TILE_ROWS, GGUFWeight, matmul_q8_reference, type_info

TILE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
M_VALUES = (24, 25, 30, 35)  # every remainder of a 3- or 4-row pass; the bit-exact test takes every one of 12
SHAPES = {False: [(37, 64), (16, 32)], True: [(37, 512), (5, 256)]}  # (N, K): a partial chunk, one chunk / block


@pytest.fixture
def tiled(kernel_ops, monkeypatch, request):
    """The kernels, for a test of one tile type (its ``qtype`` parameter, else Q4_K): skipped where the build has
    no tile kernel for it (AVX2 without VNNI: Q8_0; no AVX2: none), which test_avx2_variant.py's x86-64-v3 run
    of this file hits for Q8_0."""
    monkeypatch.setenv("OPENINFER_GGUF_ACTIVATIONS", "int8")
    qtype = getattr(request.node, "callspec", None) and request.node.callspec.params.get("qtype") or "Q4_K"
    if not kernel_ops.gguf_q8_tiled_supports(type_info(qtype)[0]):
        pytest.skip(f"this build has no tile kernel for {qtype}")
    return kernel_ops


def _expected_int_dot() -> int:
    """The integer dot product the build should have (gguf_q8_gemm.cpp's kIntDot), from the flags it was built
    for: test_avx2_variant.py reruns this file on an -march=x86-64-v3 build, the others are -march=native."""
    from openinfer.platform import cpu_info

    march = [f for f in os.environ.get("OPENINFER_KERNEL_CFLAGS", "").split() if f.startswith("-march=")]
    if march:
        return {"-march=x86-64-v3": 1, "-march=x86-64": 0}[march[-1]]
    flags = cpu_info()[1]
    return 3 if {"avx512_vnni", "avx512vl"} <= flags else 2 if "avx_vnni" in flags else 1 if "avx2" in flags else 0


def test_build_has_the_integer_dot_and_tile_types_of_its_isa(kernel_ops):
    """What the build compiled in, against its ISA: the int8 path's dot product (VNNI, AVX2 maddubs, the portable
    loop) and the tile kernel's types (Q8_0's products saturate maddubs: only with VNNI; none without AVX2)."""
    dot = _expected_int_dot()
    assert kernel_ops.gguf_int_dot() == dot
    want = ({"Q4_0", "Q4_1", "Q4_K", "Q6_K"} | ({"Q8_0"} if dot >= 2 else set())) if dot >= 1 else set()
    types = TILE_TYPES + ("Q5_0", "Q5_1", "Q5_K")
    assert {t for t in types if kernel_ops.gguf_q8_tiled_supports(type_info(t)[0])} == want


def _run(ops, qtype, data, x, bias=None):
    n = data.shape[0]
    y = torch.empty(x.shape[0], n)
    ops.gguf_linear_q8_tiled(y, torch.from_numpy(x), torch.from_numpy(data), type_info(qtype)[0],
                             None if bias is None else torch.from_numpy(bias))
    return y.double().numpy()


@pytest.mark.parametrize("qtype", TILE_TYPES)
def test_tiles_match_reference(tiled, qtype):
    for i, (n, k) in enumerate(SHAPES[qtype.endswith("_K")]):
        data = _blocks(qtype, n, k, seed=i)
        rng = np.random.default_rng(i)
        for m in M_VALUES + ((300,) if i == 0 else ()):
            x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 3, (m, 1))).astype(np.float32)
            x[:, :32] = 0
            bias = rng.standard_normal(n).astype(np.float32)
            ref = matmul_q8_reference(torch.from_numpy(x), torch.from_numpy(data), qtype, k).numpy() + bias
            got = _run(tiled, qtype, data, x, bias)
            bound = _q8_bound(x, data, qtype, k) + 2 ** -24 * np.abs(ref)  # + the bias's rounding
            assert (np.abs(got - ref) <= bound).all(), (qtype, n, k, m, np.abs(got - ref).max())
        # the layer takes this kernel from GGUF_TILE_ROWS rows on
        x = rng.standard_normal((GGUF_TILE_ROWS, k)).astype(np.float32)
        w = GGUFWeight(qtype, torch.from_numpy(data), (n, k), torch.float32)
        assert torch.equal(w.matmul(torch.from_numpy(x)), torch.from_numpy(_run(tiled, qtype, data, x)).float())


@pytest.mark.parametrize("qtype", TILE_TYPES)
def test_tiles_integer_accumulation_bit_exact(tiled, qtype):
    n, k = SHAPES[qtype.endswith("_K")][0]
    data = _unit_scale_blocks(qtype, n, k, seed=1)
    w = gq.dequantize(data, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    for m in range(24, 36):  # every remainder of the row pass (12 rows with AVX-512 VNNI, 6 / 4 / 3 below)
        x = _integer_x(m, k, seed=m)
        assert np.array_equal(_run(tiled, qtype, data, x), x.astype(np.float64) @ w.T), (qtype, m)


def test_tiles_detect_a_corrupted_scale(tiled):
    """One Q4_K super-block's fp16 d changed in the weight the kernel runs: that column leaves the bound, the
    others stay in it."""
    data = _blocks("Q4_K", 20, 512, seed=3)
    bad = data.copy()
    bad[17, 144 + 1] ^= 0x04  # row 17, second super-block, d's high byte
    x = np.random.default_rng(3).standard_normal((26, 512)).astype(np.float32)
    ref = matmul_q8_reference(torch.from_numpy(x), torch.from_numpy(data), "Q4_K", 512).numpy()
    ok = np.abs(_run(tiled, "Q4_K", bad, x) - ref) <= _q8_bound(x, data, "Q4_K", 512)
    assert np.delete(ok, 17, axis=1).all() and not ok[:, 17].any()


def test_tiles_refuse_what_they_lack(kernel_ops, monkeypatch):
    """The Q5 types have no tile decoder: the layer keeps decode + fp32 GEMM for them, and the op says no."""
    monkeypatch.setenv("OPENINFER_GGUF_ACTIVATIONS", "int8")
    code = type_info("Q5_K")[0]
    assert not kernel_ops.gguf_q8_tiled_supports(code)
    with pytest.raises(RuntimeError, match="no tile kernel"):
        kernel_ops.gguf_linear_q8_tiled(torch.empty(24, 1), torch.zeros(24, 256),
                                        torch.zeros(1, 176, dtype=torch.uint8), code, None)
    assert not gguf_quant._tiled(kernel_ops, code)


@pytest.mark.parametrize("qtype", TILE_TYPES)
def test_tiles_eight_row_decode_matches_the_tail_path(tiled, qtype):
    """A full chunk's columns are decoded 8 weight rows at a time (decode_rows8), a partial chunk's one row at a
    time (decode_row); every column is its own lanes, so the same rows give the same bits either way."""
    k = SHAPES[qtype.endswith("_K")][0][1]
    data = _blocks(qtype, 16, k, seed=5)
    x = np.random.default_rng(5).standard_normal((25, k)).astype(np.float32)
    full, tail = _run(tiled, qtype, data, x), _run(tiled, qtype, np.ascontiguousarray(data[:15]), x)
    assert np.array_equal(full[:, :15], tail), (qtype, np.abs(full[:, :15] - tail).max())


def test_small_m_entry_hands_over_to_the_tiles(tiled):
    """From gguf_q8_tile_from rows the small-M int8 op runs the tile kernel (same bits); below, its own passes
    (still within the reference bound: test_gguf_q8.py)."""
    start = tiled.gguf_q8_tile_from()
    assert 1 < start <= GGUF_TILE_ROWS
    data = _blocks("Q4_K", 40, 512, seed=7)
    code = type_info("Q4_K")[0]
    rng = np.random.default_rng(7)
    for m in (start - 1, start, GGUF_TILE_ROWS - 1):
        x = rng.standard_normal((m, 512)).astype(np.float32)
        y = torch.empty(m, 40)
        tiled.gguf_linear_q8(y, torch.from_numpy(x), torch.from_numpy(data), code, None)
        ref = matmul_q8_reference(torch.from_numpy(x), torch.from_numpy(data), "Q4_K", 512).numpy()
        assert (np.abs(y.double().numpy() - ref) <= _q8_bound(x, data, "Q4_K", 512)).all(), m
        if m >= start:
            assert np.array_equal(y.numpy(), _run(tiled, "Q4_K", data, x).astype(np.float32)), m
