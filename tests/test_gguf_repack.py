"""Q4_K / Q6_K weights repacked 8 rows at a time at load (cpu_kernels/gguf_repack.cpp, ``GGUFWeight.repacked``),
the layout the int8 kernel runs at every M when ``OPENINFER_GGUF_ACTIVATIONS=int8``:
- repack then unpack gives the file's bytes back exactly (N not a multiple of 8: zero padding rows);
- the kernel against gguf's dequantisation times x (within the activation rounding plus the fp32 bound of
  test_gguf_q8.py, nothing of the code under test in it), against ``matmul_q8_reference`` within that fp32 bound,
  and bit for bit with unit scales and integer activations (every partial sum an exact integer in fp32): N odd,
  K one super-block and three, M = 1..70 (every remainder of the 3- to 8-row passes; from ``gguf_r8_tile_from``
  rows the entry hands the repacked rows to the tile kernel, and the kernel alone is checked there too);
  a bias; an all-zero activation block; a changed scale byte leaves the bound (the check can fail);
- ``GGUFWeight.repacked`` only under int8 everywhere, and a repacked weight's dense view, rows, fp32-activation
  call and fused decode block give the file layout's values; ``prepack_linears`` repacks a Linear's weight but not
  a table shared with the embedding (tied head).
The AVX2 (maddubs) and portable builds run the reference and bit-exact checks in
``test_gguf_quant.test_gguf_kernel_isa_variants``.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants as gq
from test_gguf_q8 import _integer_x, _q8_bound, _unit_scale_blocks
from test_gguf_quant import _blocks

from openinfer.layers import dispatch
from openinfer.layers.gguf_quant import (REPACK_CODE_OFFSET, GGUFWeight, matmul_q8_reference,
                                        type_info)

TYPES = ("Q4_K", "Q6_K")
SHAPES = ((37, 768), (16, 256))  # (N, K): a padded last group, three super-blocks; whole groups, one
M_VALUES = (1, 2, 3, 5, 7, 8, 9, 13, 24, 70)


@pytest.fixture
def int8_all(kernel_ops, monkeypatch):
    monkeypatch.setenv("OPENINFER_GGUF_ACTIVATIONS", "int8")
    assert dispatch.active().gguf_int8_everywhere
    return kernel_ops


def _r8(ops, qtype, data):
    return ops.gguf_repack8(torch.from_numpy(data), type_info(qtype)[0])


def _run(ops, qtype, r, n, x, bias=None):
    y = torch.empty(x.shape[0], n)
    ops.gguf_linear_q8(y, torch.from_numpy(x), r, type_info(qtype)[0] + REPACK_CODE_OFFSET,
                       None if bias is None else torch.from_numpy(bias))
    return y.double().numpy()


@pytest.mark.parametrize("qtype", TYPES)
def test_repack_round_trip_exact(kernel_ops, qtype):
    code = type_info(qtype)[0]
    for n, k in SHAPES:
        data = _blocks(qtype, n, k)
        r = _r8(kernel_ops, qtype, data)
        assert r.shape == ((n + 7) // 8 * 8, data.shape[1] + (4 * k // 256 if qtype == "Q4_K" else 0))
        assert torch.equal(kernel_ops.gguf_unpack8(r, code + REPACK_CODE_OFFSET, n), torch.from_numpy(data))


@pytest.mark.parametrize("qtype", TYPES)
def test_repacked_kernel_against_gguf_and_reference(kernel_ops, qtype):
    for i, (n, k) in enumerate(SHAPES):
        data = _blocks(qtype, n, k, seed=i)
        w = gq.dequantize(data, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
        r = _r8(kernel_ops, qtype, data)
        rng = np.random.default_rng(i)
        for m in M_VALUES:
            x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 3, (m, 1))).astype(np.float32)
            x[:, 32:64] = 0  # an all-zero block: scale 0
            bias = rng.standard_normal(n).astype(np.float32) if m == 5 else None
            got = _run(kernel_ops, qtype, r, n, x, bias)
            if bias is not None:
                got = got - bias
            ref = matmul_q8_reference(torch.from_numpy(x), torch.from_numpy(data), qtype, k).numpy()
            fp_bound = _q8_bound(x, data, qtype, k) * (2 if bias is not None else 1)
            assert (np.abs(got - ref) <= fp_bound).all(), (qtype, n, k, m, np.abs(got - ref).max())
            if m >= kernel_ops.gguf_r8_tile_from():  # the entry handed these rows to the tiles: the kernel alone too
                y = torch.empty(m, n)
                kernel_ops.gguf_linear_q8_r8(y, torch.from_numpy(x), r, type_info(qtype)[0] + REPACK_CODE_OFFSET, None)
                assert (np.abs(y.double().numpy() - ref) <= fp_bound).all(), (qtype, n, k, m)
            dx = np.abs(x).reshape(m, -1, 32).max(-1) / 127  # against gguf: |x - d q| <= d / 2, plus the fp32 bound
            act = (np.repeat(dx, 32, axis=1) * (0.5 + 1e-4)) @ np.abs(w).T
            assert (np.abs(got - x.astype(np.float64) @ w.T) <= act + fp_bound).all(), (qtype, n, k, m)


@pytest.mark.parametrize("qtype", TYPES)
def test_repacked_integer_accumulation_bit_exact(kernel_ops, qtype):
    n, k = SHAPES[0]
    for m in (1, 4, 8, 11, 70):
        data = _unit_scale_blocks(qtype, n, k, seed=m)
        w = gq.dequantize(data, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
        x = _integer_x(m, k, seed=m)
        exact = x.astype(np.float64) @ w.T
        assert np.abs(exact).max() < 2 ** 24
        assert np.array_equal(_run(kernel_ops, qtype, _r8(kernel_ops, qtype, data), n, x), exact), (qtype, m)


def test_repacked_kernel_detects_a_changed_scale(kernel_ops):
    n, k = SHAPES[0]
    data = _blocks("Q4_K", n, k, seed=3)
    x = np.random.default_rng(3).standard_normal((4, k)).astype(np.float32)
    bad = data.copy()
    bad[21, 4] ^= 0x3  # row 21's first sub-block scale, low bits
    got = _run(kernel_ops, "Q4_K", _r8(kernel_ops, "Q4_K", bad), n, x)
    ref = matmul_q8_reference(torch.from_numpy(x), torch.from_numpy(data), "Q4_K", k).numpy()
    out = np.abs(got - ref) > _q8_bound(x, data, "Q4_K", k)
    assert out[:, 21].any() and not np.delete(out, 21, axis=1).any()


def test_repacked_weight_only_under_int8_everywhere(kernel_ops, monkeypatch):
    data = torch.from_numpy(_blocks("Q6_K", 37, 512, seed=5))
    w = GGUFWeight("Q6_K", data, (37, 512), torch.float32)
    monkeypatch.setenv("OPENINFER_GGUF_ACTIVATIONS", "auto")
    assert w.repacked() is w
    monkeypatch.setenv("OPENINFER_GGUF_ACTIVATIONS", "int8")
    r = w.repacked()
    assert r.layout == "r8" and r.code == 14 + REPACK_CODE_OFFSET and r.nbytes == 40 * 420
    assert GGUFWeight("Q8_0", torch.zeros(8, 34, dtype=torch.uint8), (8, 32), torch.float32).repacked().layout == "file"
    assert torch.equal(r.dequantize(), w.dequantize())
    idx = torch.tensor([36, 0, 9])
    assert torch.equal(r.rows(idx), w.rows(idx))
    x = torch.randn(30, 512)  # 30 rows: the file layout runs the tiles, the repacked one its own kernel
    ref = matmul_q8_reference(x, data, "Q6_K", 512).numpy()
    bound = _q8_bound(x.numpy(), data.numpy(), "Q6_K", 512)
    for y in (r.matmul(x), w.matmul(x)):
        assert (np.abs(y.double().numpy() - ref) <= bound).all()
    # fp32 activations (the head under auto) on a repacked weight: the file layout's kernel, same bits
    assert torch.equal(r.matmul(x[:3], fp32_activations=True), w.matmul(x[:3], fp32_activations=True))
    # fused q/k/v of one type: the parts' file bytes concatenated, then repacked as one
    both = GGUFWeight.cat([r, w])
    assert both.layout == "file" and torch.equal(both.data, torch.cat([data, data]))


def test_prepack_repacks_a_linear_not_a_tied_table(int8_all):
    from openinfer.layers.linear import Linear, prepack_linears
    from openinfer.layers.vocab_parallel_embedding import VocabParallelEmbedding

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = Linear(256, 16, bias=False)
            self.embed = VocabParallelEmbedding(24, 256)
            self.head = Linear(256, 24, bias=False)

    m = Tiny()
    m.proj.load_quantized(GGUFWeight("Q4_K", torch.from_numpy(_blocks("Q4_K", 16, 256)), (16, 256), torch.float32))
    table = GGUFWeight("Q6_K", torch.from_numpy(_blocks("Q6_K", 24, 256)), (24, 256), torch.float32)
    m.embed.load_quantized(table)
    m.head.load_quantized(table)  # tied: the same object
    x = torch.randn(3, 256)
    data = m.proj._quant.data
    prepack_linears(m)
    assert m.proj._quant.layout == "r8" and m.head._quant is table and table.layout == "file"
    ref = matmul_q8_reference(x, data, "Q4_K", 256).numpy()
    assert (np.abs(m.proj(x).double().numpy() - ref) <= _q8_bound(x.numpy(), data.numpy(), "Q4_K", 256)).all()
