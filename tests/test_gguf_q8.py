"""The GGUF int8 path (cpu_kernels/gguf_q8_gemm.cpp, ``KernelSelection.gguf_int8``): activations quantised to int8
per row and 32 columns, integer dot products with the file's blocks, as llama.cpp computes.

Three checks per type, odd N, one block and several, every activation-row remainder of the 4-row pass:
- bit for bit, integer accumulation: weights with scale 1 (integer mins), activations integers with a +-127 in every
  32-column block (so x's scale is exactly 1 and its int8 values are x itself): every partial sum is an integer
  below 2^24, so the fp32 result must equal gguf's dequantised W times x in float64 exactly;
- against ``matmul_q8_reference`` (the same integer math in torch, float64) within the kernel's fp32 rounding of its
  K / 4 + few terms: gamma_n * the sum of their magnitudes;
- against gguf's dequantisation times the rounded activations d q within that fp32 bound (the min terms use the
  rounded x's sums, as llama.cpp's do), and times fp32 x within the activation rounding: |x_k - d q_k| <= d / 2 per
  element, so |y - W x| <= sum_k |w_k| d_b (1/2 + 1e-4) + the fp32 bound above (``_q8_bound``), nothing of the
  code under test in the bound.
The AVX2 (maddubs) and portable builds run the same checks in ``test_gguf_quant.test_gguf_kernel_isa_variants``.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants as gq
from test_gguf_quant import GGUF_TYPES, _blocks, _oracle, _shapes

from openinfer.config import KernelConfig
from openinfer.layers import decode_blocks, dispatch
from openinfer.layers.gguf_quant import (GGUF_DEQUANT_ROWS, GGUFWeight, matmul_q8_reference,
                                        quantize_activations_q8, type_info)
from openinfer.layers.linear import Linear

U = 2.0 ** -24
M_VALUES = (1, 2, 3, 4, 5, 7, 17)  # below GGUF_DEQUANT_ROWS: the kernel, every remainder of its 4-row pass
_ONE, _TWO, _MINUS_TWO = (np.frombuffer(np.float16(v).tobytes(), np.uint8) for v in (1.0, 2.0, -2.0))


def _unit_scale_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random integers with scale 1 (d, K-types' dmin = 1; _1 types' min -2; Q6_K's sub-block scales in [-16, 16])
    so that W's values and x W^T are integers."""
    _, block, size = type_info(qtype)
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    if qtype == "Q6_K":
        b[..., 208:210] = _ONE
        b[..., 192:208] = rng.integers(-16, 17, (n, k // block, 16)).astype(np.int8).view(np.uint8)
    else:
        b[..., 0:2] = _ONE
        if qtype in ("Q4_1", "Q5_1"):
            b[..., 2:4] = _MINUS_TWO
        elif qtype in ("Q4_K", "Q5_K"):
            b[..., 2:4] = _ONE
    return b.reshape(n, -1)


def _integer_x(m: int, k: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).integers(-8, 9, (m, k)).astype(np.float32)
    x[:, ::32] = np.where(np.arange(k // 32) % 2, 127, -127)  # block scale exactly 1
    return x


def _q8_bound(x: np.ndarray, data: np.ndarray, qtype: str, k: int) -> np.ndarray:
    """The fp32 rounding of the kernel's sum: (K / 4 + 64) terms, each with a rounding or two, of magnitude at most
    |s_g| d_x |q_w| |q_x| summed (and |o_g| |sum x|, its fp32 sum of 32 more roundings)."""
    from openinfer.layers.gguf_quant import decode_reference

    q, s, o = decode_reference(torch.from_numpy(data), qtype, k)
    n, gs = q.shape[0], q.shape[-1]
    qx, dx = quantize_activations_q8(torch.from_numpy(x))
    mag = torch.einsum("mgi,ngi->mng", qx.reshape(len(x), -1, gs).abs().double(),
                       q.reshape(n, -1, gs).abs().double())
    terms = (mag * s.reshape(n, -1).abs().double()[None] * dx.double().repeat_interleave(32 // gs, 1)[:, None]).sum(-1)
    if o is not None:
        terms = terms + np.abs(x.astype(np.float64)).reshape(len(x), -1, gs).sum(-1) @ np.abs(
            o.reshape(n, -1).double().numpy()).T
    nterms = k // 4 + 64
    return nterms * U / (1 - nterms * U) * terms.numpy() + 1e-30


def _run_q8(qtype: str, data: np.ndarray, n: int, k: int, x: np.ndarray) -> np.ndarray:
    y = GGUFWeight(qtype, torch.from_numpy(data), (n, k), torch.float32).matmul(torch.from_numpy(x))
    return y.double().numpy()


@pytest.fixture
def int8_path(kernel_ops, monkeypatch):
    monkeypatch.setenv("OPENINFER_GGUF_ACTIVATIONS", "int8")
    assert dispatch.active().gguf_int8
    return kernel_ops


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_integer_accumulation_bit_exact(int8_path, qtype):
    for i, (n, k) in enumerate(_shapes(qtype)[:3]):
        data = _unit_scale_blocks(qtype, n, k, seed=i)
        w = gq.dequantize(data, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
        assert np.array_equal(w, np.round(w))
        for m in M_VALUES:
            x = _integer_x(m, k, seed=m)
            exact = x.astype(np.float64) @ w.T
            assert np.abs(exact).max() < 2 ** 24
            got = _run_q8(qtype, data, n, k, x)
            assert np.array_equal(got, exact), (qtype, n, k, m, np.abs(got - exact).max())


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_kernel_matches_its_torch_reference_and_gguf(int8_path, qtype):
    for i, (n, k) in enumerate(_shapes(qtype)):
        data = _blocks(qtype, n, k, seed=i)
        w, _ = _oracle(qtype, data)
        rng = np.random.default_rng(i + 7)
        for m in M_VALUES:
            x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 3, (m, 1))).astype(np.float32)
            x[:, :32] = 0  # an all-zero block: scale 0
            got = _run_q8(qtype, data, n, k, x)
            ref = matmul_q8_reference(torch.from_numpy(x), torch.from_numpy(data), qtype, k).numpy()
            fp_bound = _q8_bound(x, data, qtype, k)
            assert (np.abs(got - ref) <= fp_bound).all(), (qtype, n, k, m, np.abs(got - ref).max())
            # the dequantised W (min included) times the rounded activations d q, within the fp32 bound: the min
            # terms take the rounded x's sums (failed with the exact sum x for Q4_1 / Q5_1 / Q4_K / Q5_K)
            qx, dxq = quantize_activations_q8(torch.from_numpy(x))
            xhat = (qx.double().reshape(m, -1, 32) * dxq.double()[..., None]).reshape(m, k).numpy()
            assert (np.abs(got - xhat @ w.T) <= fp_bound).all(), (qtype, n, k, m, np.abs(got - xhat @ w.T).max())
            # against gguf: the activation rounding, |x - d q| <= d / 2 per element, plus the fp32 bound
            dx = np.abs(x).reshape(m, -1, 32).max(-1) / 127
            act = (np.repeat(dx, 32, axis=1) * (0.5 + 1e-4)) @ np.abs(w).T
            exact = x.astype(np.float64) @ w.T
            assert (np.abs(got - exact) <= act + fp_bound).all(), (qtype, n, k, m)


def test_activation_quantisation_reference():
    x = torch.tensor([[0.0] * 32 + [127.0, 1.5, -2.5, 0.4, -127.5] + [0.0] * 27])
    q, d = quantize_activations_q8(x)
    assert d[0, 0] == 0 and (q[0, :32] == 0).all()  # an all-zero block
    assert d[0, 1] == torch.tensor(127.5) / 127
    y = torch.tensor([127.0, 1.5, -2.5, 0.4, -127.5]) * (1 / d[0, 1])
    assert q[0, 32:37].tolist() == torch.round(y).tolist() and q[0, 36] == -127


def test_reference_detects_a_wrong_weight(int8_path):
    """One nibble changed in the weight the kernel runs: the result leaves the bound (the test can fail)."""
    data = _blocks("Q4_K", 4, 512)
    bad = data.copy()
    bad[2, 100] ^= 0x10
    x = np.random.default_rng(3).standard_normal((1, 512)).astype(np.float32)
    ref = matmul_q8_reference(torch.from_numpy(x), torch.from_numpy(data), "Q4_K", 512).numpy()
    ok = np.abs(_run_q8("Q4_K", bad, 4, 512, x) - ref) <= _q8_bound(x, data, "Q4_K", 512)
    assert ok[0, [0, 1, 3]].all() and not ok[0, 2]


def test_selection_and_switch(kernel_ops, monkeypatch):
    """auto: int8 where the build has a SIMD integer dot (VNNI or AVX2); fp32 keeps the fp32 kernel, and
    the decode block follows the same choice."""
    sel = dispatch.active()
    assert sel.gguf_int_dot in (0, 1, 2, 3)
    assert sel.gguf_int8 == (sel.gguf_int_dot >= 1)
    assert dispatch.KernelSelection(config=KernelConfig(gguf_activations="int8"), device_type="cpu", backend="cpu",
                                    ops=kernel_ops, gguf_int_dot=0).gguf_int8
    assert not dispatch.KernelSelection(config=KernelConfig(), device_type="cpu", backend="cpu", ops=kernel_ops,
                                        gguf_int_dot=0).gguf_int8
    assert not dispatch.KernelSelection(config=KernelConfig(gguf_activations="int8"), device_type="cpu",
                                        backend="torch").gguf_int8
    with pytest.raises(ValueError, match="gguf_activations='int4'"):
        KernelConfig(gguf_activations="int4")
    lin = Linear(256, 6, bias=False)
    lin.load_quantized(GGUFWeight("Q4_K", torch.from_numpy(_blocks("Q4_K", 6, 256)), (6, 256), torch.float32))
    x = torch.randn(3, 256)
    for mode, kind in (("fp32", "gguf"), ("int8", "gguf_q8")):
        monkeypatch.setenv("OPENINFER_GGUF_ACTIVATIONS", mode)
        assert decode_blocks.layer_linear(lin)[2] == decode_blocks.LINEAR_KINDS[kind]
        y = torch.empty(3, 6)
        getattr(kernel_ops, "gguf_linear_q8" if mode == "int8" else "gguf_linear")(y, x, lin._quant.data,
                                                                                    lin._quant.code, None)
        assert torch.equal(lin(x), y)  # the layer ran the kernel the switch names
    monkeypatch.setenv("OPENINFER_GGUF_ACTIVATIONS", "int8")
    assert 17 < GGUF_DEQUANT_ROWS


def test_logits_head_fp32_under_auto_int8_when_asked(kernel_ops, monkeypatch):
    """The logits head keeps fp32 activations under ``auto`` (near-tied greedy picks) and takes llama.cpp's int8
    arithmetic, like every other GGUF linear, when ``int8`` is asked for; both at decode (1 row) and prefill rows."""
    from openinfer.distributed.parallel_state import GroupCoordinator
    from openinfer.layers.vocab_parallel_embedding import ParallelLMHead

    n, k = 40, 256
    data = torch.from_numpy(_blocks("Q6_K", n, k, seed=5))
    head = ParallelLMHead(n, k, tp=GroupCoordinator())
    head.load_quantized(GGUFWeight("Q6_K", data.clone(), (n, k), torch.float32))
    code = head._quant.code
    for m in (1, GGUF_DEQUANT_ROWS + 8):
        x = torch.randn(m, k)
        fp32, q8 = torch.empty(m, n), torch.empty(m, n)
        kernel_ops.gguf_linear(fp32, x, data, code, None)
        kernel_ops.gguf_linear_q8(q8, x, data, code, None)
        # fp32 summation orders differ between the paths (~1e-6 of the scale); int8 activations far more
        tol = 1e-5 * float(fp32.abs().max())
        assert float((fp32 - q8).abs().max()) > 20 * tol
        monkeypatch.setenv("OPENINFER_GGUF_ACTIVATIONS", "auto")
        torch.testing.assert_close(head(x), fp32, rtol=0, atol=tol)  # prefill rows: decoded chunks + GEMM
        monkeypatch.setenv("OPENINFER_GGUF_ACTIVATIONS", "int8")
        assert dispatch.active().gguf_int8_everywhere
        torch.testing.assert_close(head(x), q8, rtol=0, atol=tol)  # prefill rows: the tile kernel
