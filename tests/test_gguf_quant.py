"""GGUF block-quantized weights executed packed (layers/gguf_quant.py, cpu_kernels/gguf_gemm.cpp), against llama.cpp's
own numpy dequantisation (``gguf.quants.dequantize``) in float64.

The bound: the kernel computes y = sum_g s_g fl(sum_{k in g} q_k x_k) + sum_g o_g fl(sum_{k in g} x_k) in fp32 (the
weights w_k = s_g q_k + o_g exactly as gguf dequantises them, the products q_k x_k and the sums rounded); the torch
reference computes fl(sum_k w_k x_k). Either is a sum of at most K + 2 terms of magnitudes |x_k| |s_g q_k| and
|x_k| |o_g|, each rounded at most K + 2 times with unit roundoff u = 2^-24, so (Higham, Accuracy and Stability,
eq. 3.5) |y_fp32 - y_exact| <= gamma_{K+2} sum_k |x_k| (|s_g q_k| + |o_g|) with gamma_n = n u / (1 - n u); plus
one rounding of the output, u |y|. ``_bound`` evaluates that with |s_g q_k| = |w_k - o_g| and o_g taken from gguf's
own dequantisation of the block with its quants zeroed (so the bound uses nothing of the code under test). The
oracle's float64 product of the fp32 weights with fp32 x is exact to ~1e-16 relative, far inside the bound.
``test_bound_catches_a_wrong_weight`` shows the bound is not vacuous: one changed nibble breaks it.
"""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import kernel_prebuild
import numpy as np
import pytest
import torch
from gguf import quants as gq

from openinfer.layers import decode_blocks
from openinfer.layers.gguf_quant import (GGUF_DEQUANT_ROWS, GGUF_TYPES, GGUFWeight, GGUFWeightParts,
                                        dequantize_reference, type_info)
from openinfer.layers.linear import Linear

U = 2.0 ** -24


@pytest.fixture(autouse=True)
def _fp32_activations(monkeypatch):
    """These tests hold the fp32-activation kernel (gguf_gemm.cpp) to fp32 rounding; the int8 one
    (gguf_q8_gemm.cpp, the default on VNNI / AVX2 builds) has its own bounds in test_gguf_q8.py."""
    monkeypatch.setenv("OPENINFER_GGUF_ACTIVATIONS", "fp32")
# the bytes of each format's integers, per block (zeroing them leaves each element at its offset o_g)
_QUANT_BYTES = {"Q8_0": (2, 34), "Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_0": (2, 22), "Q5_1": (4, 24),
                "Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192)}


def _blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid rows of ``qtype``, uint8 [n, row_bytes]: gguf's own quantizer where it has one (Q8_0, Q4_0, Q4_1,
    Q5_0, Q5_1), else random integers and scale bytes with sane fp16 super-block scales (d, dmin in [1e-3, 2e-2])."""
    rng = np.random.default_rng(seed)
    t = gguf.GGMLQuantizationType[qtype]
    _, block, size = type_info(qtype)
    if qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        return gq.quantize((rng.standard_normal((n, k)) * rng.uniform(0.5, 2, (n, 1))).astype(np.float32), t)
    b = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 2e-2, (n, k // block, 2 if qtype != "Q6_K" else 1)).astype(np.float16)
    raw = np.frombuffer(scales.tobytes(), np.uint8).reshape(n, k // block, -1)
    if qtype == "Q6_K":
        b[..., 208:210] = raw
    else:
        b[..., 0:4] = raw
    return b.reshape(n, -1)


def _oracle(qtype: str, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W, the per-element offsets o) as float64 [N, K], from gguf's numpy dequantisation."""
    t = gguf.GGMLQuantizationType[qtype]
    _, block, size = type_info(qtype)
    w = gq.dequantize(data, t).astype(np.float64)
    zeroed = data.reshape(data.shape[0], -1, size).copy()
    lo, hi = _QUANT_BYTES[qtype]
    zeroed[..., lo:hi] = 0
    if qtype == "Q4_0":
        zeroed[..., lo:hi] = 0x88  # q = 8: w = 0, the offset is inside the integer
    elif qtype == "Q5_0":
        zeroed[..., 2:6] = 0xFF  # 5th bits set, nibbles 0: q = 16
    elif qtype == "Q6_K":
        zeroed[..., 0:128] = 0  # low 4 bits 0, high 2 bits 2: q = 32
        zeroed[..., 128:192] = 0xAA
    o = gq.dequantize(zeroed.reshape(data.shape), t).astype(np.float64)
    return w, o


def _bound(x: np.ndarray, w: np.ndarray, o: np.ndarray, y: np.ndarray) -> np.ndarray:
    k = w.shape[1]
    gamma = (k + 2) * U / (1 - (k + 2) * U)
    return gamma * (np.abs(x) @ (np.abs(w - o) + np.abs(o)).T) + U * np.abs(y) + 1e-30


def _check(qtype: str, n: int, k: int, ms: tuple[int, ...], seed: int = 0) -> None:
    data = _blocks(qtype, n, k, seed)
    w, o = _oracle(qtype, data)
    gw = GGUFWeight(qtype, torch.from_numpy(data), (n, k), torch.float32)
    rng = np.random.default_rng(seed + 1)
    for m in ms:
        x = rng.standard_normal((m, k)).astype(np.float32)
        bias = rng.standard_normal(n).astype(np.float32)
        exact = x.astype(np.float64) @ w.T + bias
        got = gw.matmul(torch.from_numpy(x), torch.from_numpy(bias)).double().numpy()
        tol = _bound(x, w, o, exact) + U * np.abs(bias)  # the bias adds one rounding
        err = np.abs(got - exact)
        assert (err <= tol).all(), (f"{qtype} N={n} K={k} M={m}: max err {err.max():.3g}, worst err/bound "
                                    f"{(err / tol).max():.3g}")


SHAPES_32 = [(1, 32), (5, 32), (7, 64), (13, 96), (37, 576)]  # K: one block, several; N odd
SHAPES_256 = [(1, 256), (5, 256), (7, 512), (13, 768)]
M_VALUES = (1, 2, 3, 7, 17, 33, 70)  # 1-17: the register tile (4 rows a pass, every remainder); 33, 70: decoded
# rows + GEMM (GGUF_DEQUANT_ROWS)


def _shapes(qtype: str):
    return SHAPES_256 if qtype.endswith("_K") else SHAPES_32


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_dequantize_matches_gguf_bit_for_bit(kernel_ops, qtype):
    """The kernel's decoder and the torch reference decoder give gguf's values to the bit, and ``rows`` only the
    rows asked for."""
    for n, k in _shapes(qtype):
        data = _blocks(qtype, n, k, seed=n)
        w = gq.dequantize(data, gguf.GGMLQuantizationType[qtype])
        gw = GGUFWeight(qtype, torch.from_numpy(data), (n, k), torch.bfloat16)
        assert np.array_equal(gw.dequantize().numpy(), w)
        assert np.array_equal(dequantize_reference(torch.from_numpy(data), qtype, k).numpy(), w)
        idx = torch.tensor([n - 1, 0, n // 2, n - 1])
        assert np.array_equal(gw.rows(idx).numpy(), w[idx.numpy()])
        assert gw.to_dense().dtype == torch.bfloat16 and gw.nbytes == data.size and gw.numel() == n * k


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_kernel_within_fp32_rounding_of_gguf(kernel_ops, qtype):
    assert 17 < GGUF_DEQUANT_ROWS <= 33  # both paths covered
    for i, (n, k) in enumerate(_shapes(qtype)):
        _check(qtype, n, k, M_VALUES, seed=i)


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_torch_reference_within_fp32_rounding_of_gguf(monkeypatch, qtype):
    monkeypatch.setenv("OPENINFER_CPU_KERNELS", "0")
    n, k = _shapes(qtype)[-1]
    _check(qtype, n, k, (1, 7, 70))
    data = _blocks(qtype, 3, k)
    gw = GGUFWeight(qtype, torch.from_numpy(data), (3, k), torch.float32)
    assert np.array_equal(gw.rows(torch.tensor([2, 0])).numpy(),
                          gq.dequantize(data, gguf.GGMLQuantizationType[qtype])[[2, 0]])


def test_bound_catches_a_wrong_weight(kernel_ops):
    """One nibble changed in the weight the kernel runs: the result leaves the bound (the test can fail)."""
    data = _blocks("Q4_K", 4, 512)
    w, o = _oracle("Q4_K", data)
    bad = data.copy()
    bad[2, 100] ^= 0x10  # one high nibble of one sub-block of row 2
    x = np.random.default_rng(3).standard_normal((1, 512)).astype(np.float32)
    exact = x.astype(np.float64) @ w.T
    got = GGUFWeight("Q4_K", torch.from_numpy(bad), (4, 512), torch.float32).matmul(torch.from_numpy(x)).numpy()
    ok = np.abs(got - exact) <= _bound(x, w, o, exact)
    assert ok[0, [0, 1, 3]].all() and not ok[0, 2]


def test_bf16_activations_and_leading_dims(kernel_ops):
    data = _blocks("Q6_K", 9, 256)
    gw = GGUFWeight("Q6_K", torch.from_numpy(data), (9, 256), torch.bfloat16)
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    y = gw.matmul(x)
    assert y.shape == (2, 3, 9) and y.dtype == torch.bfloat16
    w = torch.from_numpy(gq.dequantize(data, gguf.GGMLQuantizationType.Q6_K)).double()
    ref = x.double().reshape(6, 256) @ w.T
    torch.testing.assert_close(y.reshape(6, 9).double(), ref, rtol=1e-2, atol=1e-2)  # bf16 output rounding


def test_cat_same_type_and_mixed(kernel_ops):
    a, b, c = _blocks("Q4_K", 6, 512, 1), _blocks("Q4_K", 3, 512, 2), _blocks("Q6_K", 5, 512, 3)
    wa, wb, wc = (GGUFWeight(t, torch.from_numpy(d), (d.shape[0], 512), torch.float32)
                  for t, d in (("Q4_K", a), ("Q4_K", b), ("Q6_K", c)))
    same = GGUFWeight.cat([wa, wb])
    assert isinstance(same, GGUFWeight) and same.shape == (9, 512) and same.qtype == "Q4_K"
    mixed = GGUFWeight.cat([wa, wc, wb])
    assert isinstance(mixed, GGUFWeightParts) and mixed.shape == (14, 512) and mixed.nbytes == a.size + b.size + c.size
    w = np.concatenate([gq.dequantize(d, gguf.GGMLQuantizationType[t]) for t, d in (("Q4_K", a), ("Q6_K", c),
                                                                                      ("Q4_K", b))])
    assert np.array_equal(mixed.dequantize().numpy(), w)
    assert np.array_equal(mixed.rows(torch.tensor([13, 6, 0, 7])).numpy(), w[[13, 6, 0, 7]])
    with pytest.raises(ValueError, match="out of range"):
        mixed.rows(torch.tensor([14]))
    x = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)
    bias = torch.randn(14)
    exact = x.astype(np.float64) @ w.T.astype(np.float64) + bias.double().numpy()
    for fused in (mixed, GGUFWeight.cat([wa, wc, wb])):
        got = fused.matmul(torch.from_numpy(x), bias).double().numpy()
        np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4)


def test_linear_load_quantized_takes_gguf_parts(kernel_ops):
    """Linear.load_quantized assembles a fused q/k/v from GGUF parts of different types and runs them packed."""
    lin = Linear(256, 12, bias=False)
    parts = [("Q4_K", 6), ("Q6_K", 3), ("Q6_K", 3)]
    datas = [_blocks(t, n, 256, i) for i, (t, n) in enumerate(parts)]
    for i, ((t, n), d) in enumerate(zip(parts, datas)):
        lin.load_quantized(GGUFWeight(t, torch.from_numpy(d), (n, 256), torch.float32), part=i, sizes=[6, 3, 3])
    assert lin._quant is not None and lin.weight.numel() == 0
    w = np.concatenate([gq.dequantize(d, gguf.GGMLQuantizationType[t]) for (t, _), d in zip(parts, datas)])
    x = torch.randn(2, 256)
    np.testing.assert_allclose(lin(x).double().numpy(), x.double().numpy() @ w.T.astype(np.float64), rtol=1e-4,
                               atol=1e-4)
    assert torch.equal(lin.dense_weight(), torch.from_numpy(w))
    # a fused weight of two types: the Llama decode block runs each part's kernel into its columns
    parts_data, table, kind, _ = decode_blocks.layer_linear(lin)
    assert kind == decode_blocks.LINEAR_KINDS["gguf_parts"]
    assert [d.data_ptr() for d in parts_data] == [p.data.data_ptr() for p in lin._quant.parts]
    assert table.tolist() == [[int(gguf.GGMLQuantizationType[t]), n, 0] for t, n in parts]  # 0: fp32 activations
    one = Linear(256, 6, bias=False)
    one.load_quantized(GGUFWeight("Q4_K", torch.from_numpy(datas[0]), (6, 256), torch.float32))
    data, scales, kind, code = decode_blocks.layer_linear(one)
    assert data is one._quant.data and scales is None and kind == decode_blocks.LINEAR_KINDS["gguf"]  # fp32 here
    assert code == int(gguf.GGMLQuantizationType.Q4_K)


def test_bad_input_is_a_value_error():
    good = _blocks("Q4_0", 2, 64)
    with pytest.raises(ValueError, match="Q4_0.*36 bytes per row"):
        GGUFWeight("Q4_0", torch.from_numpy(good[:, :30].copy()), (2, 64), torch.float32)
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        GGUFWeight("Q4_0", torch.from_numpy(good), (2, 72), torch.float32)
    with pytest.raises(ValueError, match="Q4_K.*multiple of the block size 256"):
        GGUFWeight("Q4_K", torch.zeros(2, 144, dtype=torch.uint8), (2, 128), torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        GGUFWeight("Q4_0", torch.from_numpy(good).to(torch.int16), (2, 64), torch.float32)
    with pytest.raises(ValueError, match="'IQ2_XS' is not supported"):
        GGUFWeight("IQ2_XS", torch.from_numpy(good), (2, 64), torch.float32)
    with pytest.raises(ValueError, match="not supported"):
        GGUFWeight("F32", torch.from_numpy(good), (2, 64), torch.float32)


_VARIANT_CHECK = """
import sys
import gguf
import numpy as np, torch
from gguf import quants as gq
from torch.utils import cpp_extension
sys.path.insert(0, {tests!r})
from kernel_prebuild import gguf_load_args
cpp_extension.load(**gguf_load_args({march!r}, {build!r}))
ops = torch.ops.openinfer_cpu
import test_gguf_quant as t
import test_gguf_q8 as t8
from openinfer.layers import decode_blocks
from openinfer.layers.gguf_quant import matmul_q8_reference, type_info
print("integer dot", ops.gguf_int_dot())
for qt in t.GGUF_TYPES:
    for n, k in t._shapes(qt):
        d = t._blocks(qt, n, k)
        w, o = t._oracle(qt, d)
        code = type_info(qt)[0]
        out = torch.empty(n, k)
        ops.gguf_dequantize(out, torch.from_numpy(d), code)
        assert np.array_equal(out.numpy(), w.astype(np.float32)), qt
        for m in (1, 2, 3, 7):
            x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
            y = torch.empty(m, n)
            ops.gguf_linear(y, torch.from_numpy(x), torch.from_numpy(d), code, None)
            exact = x.astype(np.float64) @ w.T
            assert (np.abs(y.numpy() - exact) <= t._bound(x, w, o, exact)).all(), (qt, n, k, m)
            # the int8 path (gguf_q8_gemm.cpp): its integer math to the bit, its fp32 sums within their rounding
            ops.gguf_linear_q8(y, torch.from_numpy(x), torch.from_numpy(d), code, None)
            ref = matmul_q8_reference(torch.from_numpy(x), torch.from_numpy(d), qt, k).numpy()
            assert (np.abs(y.numpy() - ref) <= t8._q8_bound(x, d, qt, k)).all(), ("q8", qt, n, k, m)
            du = t8._unit_scale_blocks(qt, n, k, seed=m)
            xi = t8._integer_x(m, k, seed=m)
            ops.gguf_linear_q8(y, torch.from_numpy(xi), torch.from_numpy(du), code, None)
            wu = gq.dequantize(du, gguf.GGMLQuantizationType[qt]).astype(np.float64)
            assert np.array_equal(y.numpy(), xi.astype(np.float64) @ wu.T), ("q8 exact", qt, n, k, m)
        if ops.gguf_q8_tiled_supports(code):  # the prefill tile kernel (gguf_q8_tiles.cpp) on the same weights
            for m in (24, 27):
                x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
                y = torch.empty(m, n)
                ops.gguf_linear_q8_tiled(y, torch.from_numpy(x), torch.from_numpy(d), code, None)
                ref = matmul_q8_reference(torch.from_numpy(x), torch.from_numpy(d), qt, k).numpy()
                assert (np.abs(y.numpy() - ref) <= t8._q8_bound(x, d, qt, k)).all(), ("tiles", qt, n, k, m)
        if qt in ("Q4_K", "Q6_K"):  # the load-time repacked layout (gguf_repack.cpp): its kernel at every M
            r = ops.gguf_repack8(torch.from_numpy(d), code)
            assert torch.equal(ops.gguf_unpack8(r, code + 1000, n), torch.from_numpy(d)), ("r8 bytes", qt, n, k)
            for m in (1, 5, 9, 33):  # 33: the tile kernel on the repacked rows (AVX2)
                x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
                y = torch.empty(m, n)
                ops.gguf_linear_q8(y, torch.from_numpy(x), r, code + 1000, None)
                ref = matmul_q8_reference(torch.from_numpy(x), torch.from_numpy(d), qt, k).numpy()
                assert (np.abs(y.numpy() - ref) <= t8._q8_bound(x, d, qt, k)).all(), ("r8", qt, n, k, m)
                du = t8._unit_scale_blocks(qt, n, k, seed=m)
                xi = t8._integer_x(m, k, seed=m)
                ops.gguf_linear_q8(y, torch.from_numpy(xi), ops.gguf_repack8(torch.from_numpy(du), code), code + 1000,
                                   None)
                wu = gq.dequantize(du, gguf.GGMLQuantizationType[qt]).astype(np.float64)
                assert np.array_equal(y.numpy(), xi.astype(np.float64) @ wu.T), ("r8 exact", qt, n, k, m)
print("tiled", sorted(qt for qt in t.GGUF_TYPES if ops.gguf_q8_tiled_supports(type_info(qt)[0])))
print("variant ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_gguf_kernel_isa_variants(march, tmp_path):
    """The GGUF kernels built alone (their four sources, not the whole extension) for AVX2 without AVX-VNNI
    (x86-64-v3: the maddubs code CI's AVX2 hosts run) and for plain x86-64 (the portable loop, what non-x86 hosts
    run), checked as above in a subprocess (its ops register under the same names as the main build's). On an
    AVX-512 host the x86-64-v3 build is test_avx2_variant.py's, which reruns this file's, the int8 files' and the
    repack's kernel tests on it (one build, not two); on a plain AVX2 host the native build is that build. Under
    xdist the x86-64 build is compiled at idle priority from the run's start (kernel_prebuild) and loaded here."""
    import platform

    from openinfer.platform import cpu_info

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    if march == "x86-64-v3" and "avx512f" in cpu_info()[1]:
        pytest.skip("AVX-512 here: test_avx2_variant.py runs these files on its x86-64-v3 build")
    if march == "x86-64-v3" and "avx_vnni" not in cpu_info()[1]:
        pytest.skip("no AVX-VNNI here: the native build is the x86-64-v3 build, which the tests above ran")
    tests = os.path.dirname(os.path.abspath(__file__))
    build = str(tmp_path)
    if march == "x86-64" and kernel_prebuild.wait("gguf-x86-64", timeout_s=840) is not None:
        build = kernel_prebuild.build_dir("gguf-x86-64")  # xdist's controller built it at idle priority
    code = _VARIANT_CHECK.format(tests=tests, march=march, build=build)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900,
                       check=False, cwd=os.path.dirname(tests))
    assert r.returncode == 0 and "variant ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    # the int8 path's dot product in that build: AVX2 maddubs (x86-64-v3), the portable loop (x86-64)
    assert f"integer dot {1 if march == 'x86-64-v3' else 0}" in r.stdout, r.stdout[-3000:]
    # the prefill tile kernel: AVX2 has it for the 4-bit and Q6_K types (Q8_0's products would saturate maddubs),
    # the portable build for none (the layer decodes to fp32 for a GEMM there)
    tiled = "['Q4_0', 'Q4_1', 'Q4_K', 'Q6_K']" if march == "x86-64-v3" else "[]"
    assert f"tiled {tiled}" in r.stdout, r.stdout[-3000:]
