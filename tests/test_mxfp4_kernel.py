"""MXFP4 weights kept packed (layers/mxfp4.py): the kernel layout against the checkpoint's dequantisation, the C++
kernel (cpu_kernels/mxfp4_gemm.cpp) against the torch reference (dequantise, then an fp32 matmul) with ragged K
and N, M = 1, 3, 17, 64, NaN scales, and the same kernel built for plain x86-64 (no AVX2) and for AVX2."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openinfer.layers import cpu_ops
from openinfer.layers.fp8 import E8M0_DTYPE
from openinfer.layers.mxfp4 import (Mxfp4Tensor, Mxfp4Weight, dequantize_kernel_layout, dequantize_mxfp4, quantize_mxfp4,
                                    stacked_mxfp4, to_kernel_layout)

# (N, K): K even (two values per byte), ragged against the 32-column scale blocks where it can be
SHAPES = [(1, 32), (5, 48), (37, 70), (64, 256), (13, 1024), (9, 2)]


def _random_mxfp4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every nibble and a spread of scale exponents (2^-6 .. 2^5), as the checkpoint stores them."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8).view(torch.int8)
    scale = torch.randint(121, 133, (n, -(-k // 32)), generator=g, dtype=torch.uint8).view(E8M0_DTYPE)
    return packed, scale


def test_kernel_layout_dequantises_like_the_checkpoint():
    for i, (n, k) in enumerate(SHAPES):
        packed, scale = _random_mxfp4(n, k, i)
        q, s = to_kernel_layout(packed, scale)
        assert q.dtype == torch.uint8 and q.shape == (n, -(-k // 32) * 16) and s.shape == scale.shape
        assert torch.equal(dequantize_kernel_layout(q, s, k), dequantize_mxfp4(packed, scale, torch.float32))
    # byte i of a block: column i low, column i + 16 high (column j holds magnitude index j % 8, scale 2^0)
    w = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 4])
    q, _ = to_kernel_layout(*quantize_mxfp4(w))
    assert q[0, :8].tolist() == [0, 1 | 1 << 4, 2 | 2 << 4, 3 | 3 << 4, 4 | 4 << 4, 5 | 5 << 4, 6 | 6 << 4, 7 | 7 << 4]


def test_packed_bytes_and_stacked_views():
    ws = stacked_mxfp4(3, 10, 70, torch.bfloat16)
    assert [w.nbytes for w in ws] == [10 * 48 + 10 * 3] * 3  # 70 -> 96 columns: 48 code bytes + 3 scales a row
    assert ws[1].qweight.untyped_storage().data_ptr() == ws[0].qweight.untyped_storage().data_ptr()
    packed, scale = _random_mxfp4(4, 70, 0)
    ws[1].load_rows(6, Mxfp4Tensor(packed, scale))
    dense = ws[1].dequantize()
    assert torch.equal(dense[6:], dequantize_mxfp4(packed, scale, torch.float32)) and not dense[:6].any()
    assert not ws[0].dequantize().any() and not ws[2].dequantize().any()
    with pytest.raises(ValueError, match="does not fit rows 8:12"):
        ws[1].load_rows(8, Mxfp4Tensor(packed, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_kernel_matches_torch_reference(monkeypatch, dtype):
    assert cpu_ops.available(), "the CPU kernels must build on this host (else nothing here tests the kernel)"
    for i, (n, k) in enumerate(SHAPES):
        packed, scale = _random_mxfp4(n, k, i)
        w = Mxfp4Weight.from_checkpoint(packed, scale, dtype)
        exact = dequantize_mxfp4(packed, scale, torch.float32)
        for m in (1, 3, 17, 64):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 * i + m)).to(dtype)
            fast = w.matmul(x)
            with monkeypatch.context() as mp:
                mp.setenv("OPENINFER_CPU_KERNELS", "0")
                ref = w.matmul(x)
            want = F.linear(x.float(), exact)
            # batch invariance: a row's result does not depend on the rows sharing its call (M = 1, 2 decode in
            # registers, M > 2 through the scratch; the same arithmetic either way)
            assert torch.equal(fast[m - 1:], w.matmul(x[m - 1:])) and torch.equal(fast[:2], w.matmul(x[:2]))
            assert fast.dtype == ref.dtype == dtype and fast.shape == ref.shape == (m, n)
            tol = 1e-5 * float(want.abs().max()) * max(k, 32) ** 0.5
            # the reference is dequantise-then-matmul (a strided weight view: another BLAS summation order)
            torch.testing.assert_close(ref.float(), want.to(dtype).float(), rtol=1e-5 if dtype == torch.float32
                                       else 8e-3, atol=tol)
            if dtype == torch.float32:
                torch.testing.assert_close(fast, want, rtol=1e-5, atol=tol)
            else:  # rounded to bf16 once: at most one bf16 step apart
                torch.testing.assert_close(fast.float(), want.to(dtype).float(), rtol=8e-3, atol=tol)


def test_mxfp4_kernel_nan_scales_and_bias(monkeypatch):
    assert cpu_ops.available()
    packed, scale = _random_mxfp4(7, 96, 3)
    raw = scale.view(torch.uint8).clone()
    raw[2, 1] = 255  # UE8M0 NaN: row 2 is NaN for every activation row, as the reference gives
    raw[5, 0] = 0  # 2^-127: subnormal, still exact
    scale = raw.view(E8M0_DTYPE)
    w = Mxfp4Weight.from_checkpoint(packed, scale, torch.float32)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(7, generator=torch.Generator().manual_seed(1))
    fast = w.matmul(x, bias)
    with monkeypatch.context() as mp:
        mp.setenv("OPENINFER_CPU_KERNELS", "0")
        ref = w.matmul(x, bias)
    assert fast[:, 2].isnan().all() and ref[:, 2].isnan().all()
    assert not fast[:, [0, 1, 3, 4, 5, 6]].isnan().any()
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    # an infinite activation times a zero code is NaN in both (no shortcut skips zero weights)
    x[0, 0] = float("inf")
    fast, ref = w.matmul(x), F.linear(x, w.dequantize())
    assert torch.equal(fast[0].isnan(), ref[0].isnan()) and torch.equal(fast[0].isinf(), ref[0].isinf())


# The kernel tests above run again on the x86-64-v3 (AVX2) build: tests/test_avx2_variant.py.
