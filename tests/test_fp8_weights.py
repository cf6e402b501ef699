"""FP8 block-quantised linears kept packed (``layers/fp8.py::Fp8Weight``, ``cpu_kernels/fp8_gemm.cpp``): the kernel
against the dequantised reference, every e4m3 code decoded exactly, batch and thread invariance, fused rows, and
the checks at load."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openinfer.layers import cpu_ops
from openinfer.layers.fp8 import FP8_DEQUANT_ROWS, FP8_DTYPE, Fp8Weight, dequantize_fp8_block, quantize_fp8_block


def _weight(n: int, k: int, block=(128, 128), fmt="float32", seed=0) -> tuple[Fp8Weight, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    q, s = quantize_fp8_block(w, block, fmt)
    return Fp8Weight.from_checkpoint(q, s, block), dequantize_fp8_block(q, s, block, torch.float32)


@pytest.mark.parametrize("n,k,block,fmt", [(5, 24, (128, 128), "float32"), (130, 136, (128, 128), "ue8m0"),
                                           (67, 264, (32, 64), "float32"), (1, 8, (128, 128), "float32")])
@pytest.mark.parametrize("m", [1, 2, 3, 17, FP8_DEQUANT_ROWS + 3])
def test_fp8_kernel_matches_reference(kernel_ops, n, k, block, fmt, m):
    w, ref = _weight(n, k, block, fmt)
    assert torch.equal(w.dequantize(), ref)  # the reference's weights are dequantize_fp8_block's, exactly
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n)
    torch.testing.assert_close(w.matmul(x, bias), F.linear(x.double(), ref.double(), bias.double()).float(),
                               rtol=1e-5, atol=1e-5)
    xb = x.bfloat16()  # other activation dtypes come back in their dtype
    assert w.matmul(xb).dtype == torch.bfloat16


def test_fp8_kernel_decodes_every_code_exactly(kernel_ops):
    """All 254 non-NaN codes (subnormals, +-0, the largest 448) in one row under two block multipliers: one-hot
    activations read each weight back bit for bit, on the register path (1-2 rows) and the scratch path (3+)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    k = codes.numel()
    weight = torch.stack([codes, codes.flip(0)]).view(FP8_DTYPE)
    scale = torch.tensor([[0.37, 2.0 ** -20]])  # one block row, two block columns of 128
    w = Fp8Weight.from_checkpoint(weight, scale, (128, 128))
    ref = dequantize_fp8_block(weight, scale, (128, 128), torch.float32)
    eye = torch.eye(k)
    assert torch.equal(w.matmul(eye), ref.t())  # >= FP8_DEQUANT_ROWS rows: the matrix decoded whole
    for i in range(0, k, 32):  # fewer rows: the tile kernel (scratch-decoded)
        assert torch.equal(w.matmul(eye[i:i + 32]), ref.t()[i:i + 32])
    for i in (0, 1, 5, k - 1):
        assert torch.equal(w.matmul(eye[i:i + 1]), ref.t()[i:i + 1])
        assert torch.equal(w.matmul(eye[i:i + 2]), ref.t()[i:i + 2])


def test_fp8_kernel_is_batch_and_thread_invariant(kernel_ops):
    """Below FP8_DEQUANT_ROWS a row's result does not depend on how many rows share the call, nor (at any row
    count) on the thread count."""
    w, _ = _weight(260, 384)
    x = torch.randn(19, 384, generator=torch.Generator().manual_seed(3))
    full = w.matmul(x)
    for i in (0, 7, 18):
        assert torch.equal(w.matmul(x[i:i + 1]), full[i:i + 1])
    threads = torch.get_num_threads()
    many = torch.randn(FP8_DEQUANT_ROWS, 384)
    try:
        torch.set_num_threads(1)
        one, one_many = w.matmul(x), w.matmul(many)
        torch.set_num_threads(2)
        assert torch.equal(w.matmul(x), one)
        decoded = torch.empty(260, 384)
        kernel_ops.fp8_dequantize(decoded, w.qweight, w.scales, w.group)
        assert torch.equal(decoded, w.dequantize())  # the whole-matrix decode (2 threads) is exact
        torch.testing.assert_close(w.matmul(many), one_many, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_fp8_torch_reference_path(monkeypatch):
    """Without the kernel (no compiler, OPENINFER_CPU_KERNELS=0, a GPU tensor) the weight is dequantised for the
    call and multiplied in fp32."""
    w, ref = _weight(33, 136)
    monkeypatch.setattr(cpu_ops, "ops_for", lambda *t: None)
    x = torch.randn(4, 136)
    assert torch.equal(w.matmul(x), F.linear(x, ref))


def test_fp8_fused_rows_keep_each_rows_multipliers(kernel_ops):
    """gate and up fused into one projection: rows keep their own block multipliers, whatever the row counts."""
    a, ra = _weight(70, 136, seed=1)
    b, rb = _weight(45, 136, seed=2)
    fused = Fp8Weight.cat([a, b])
    assert tuple(fused.shape) == (115, 136)
    assert torch.equal(fused.dequantize(), torch.cat([ra, rb]))
    x = torch.randn(2, 136)
    assert torch.equal(fused.matmul(x), torch.cat([a.matmul(x), b.matmul(x)], dim=1))
    c, _ = _weight(8, 64)
    with pytest.raises(ValueError, match="different layouts"):
        Fp8Weight.cat([a, c])


def test_fp8_weight_checks_at_load():
    q, s = quantize_fp8_block(torch.randn(16, 32), (128, 128))
    nan = q.clone().view(torch.uint8)
    nan[3, 5] = 0xFF
    with pytest.raises(ValueError, match="NaN codes"):
        Fp8Weight.from_checkpoint(nan.view(FP8_DTYPE), s, (128, 128))
    with pytest.raises(ValueError, match="divisible by 8"):
        Fp8Weight.from_checkpoint(q, torch.ones(16, 3), (1, 12))
    with pytest.raises(ValueError, match="weight_scale_inv has shape"):
        Fp8Weight.from_checkpoint(q, torch.ones(2, 1), (128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Weight.from_checkpoint(q.float(), s, (128, 128))
    w = Fp8Weight.from_checkpoint(q, s, (128, 128))
    assert w.nbytes == 16 * 32 + 16 * 1 * 4  # the codes plus one fp32 multiplier per row and block


# The kernel tests above run again on the x86-64-v3 (AVX2) build: tests/test_avx2_variant.py.
