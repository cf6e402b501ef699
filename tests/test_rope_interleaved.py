"""DeepSeek's interleaved rotary as one kernel op (cpu_kernels/rope_interleaved.cpp) against the torch path of
rotary.apply_interleaved it replaces: the same bits for every layout the models use."""
from __future__ import annotations

import pytest
import torch

from openinfer.layers import cpu_ops
from openinfer.layers.rotary import apply_interleaved


def _torch_path(monkeypatch, *args, **kw):
    with monkeypatch.context() as m:
        m.setenv("OPENINFER_CPU_KERNELS", "0")
        assert cpu_ops.get_ops() is None
        return apply_interleaved(*args, **kw)


def _cos_sin(t, half, gen):
    ang = torch.rand(t, half, generator=gen) * 6.3
    return ang.cos(), ang.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("deinterleave", [False, True])
@pytest.mark.parametrize("shape, half", [((5, 8, 64), 32), ((3, 64), 32), ((4, 2, 3, 48), 8), ((7, 1, 10), 5)])
def test_kernel_same_bits_as_torch_path(kernel_ops, monkeypatch, dtype, inverse, deinterleave, shape, half):
    gen = torch.Generator().manual_seed(sum(shape) + half)
    x = torch.randn(*shape, generator=gen).to(dtype)
    cos, sin = _cos_sin(shape[0], half, gen)
    got = apply_interleaved(x, cos, sin, inverse=inverse, deinterleave=deinterleave)
    want = _torch_path(monkeypatch, x, cos, sin, inverse=inverse, deinterleave=deinterleave)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want)


def test_kernel_reads_strided_views(kernel_ops, monkeypatch):
    """q_pe is a view into the q projection ([T, H, nope + rope], the rope dims last): read through its strides."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(6, 8, 192, generator=gen)
    q_nope, q_pe = q.split([128, 64], dim=-1)
    cos, sin = _cos_sin(6, 32, gen)
    got = apply_interleaved(q_pe, cos, sin, deinterleave=True)
    assert got.is_contiguous()
    assert torch.equal(got, _torch_path(monkeypatch, q_pe.contiguous(), cos, sin, deinterleave=True))
    # and an interleave / de-rotate round trip gives x back (to rounding)
    back = apply_interleaved(apply_interleaved(q_pe, cos, sin), cos, sin, inverse=True)
    torch.testing.assert_close(back, q_pe, rtol=1e-5, atol=1e-5)


def test_wrapper_declines_what_the_kernel_does_not_take(kernel_ops):
    x = torch.randn(4, 2, 16)
    cos, sin = torch.rand(4, 8), torch.rand(4, 8)
    assert cpu_ops.rope_interleaved(x, cos.double(), sin.double(), False, False) is None  # fp64 tables
    assert cpu_ops.rope_interleaved(x.double(), cos, sin, False, False) is None          # fp64 x
    assert cpu_ops.rope_interleaved(x, cos[:3], sin[:3], False, False) is None          # T mismatch
    assert cpu_ops.rope_interleaved(x[..., :8], torch.rand(4, 5), torch.rand(4, 5), False, False) is None  # rd > D
    empty = cpu_ops.rope_interleaved(x[:0], cos[:0], sin[:0], False, False)
    assert empty is not None and empty.shape == (0, 2, 16)


def test_op_names_bad_arguments(kernel_ops):
    x = torch.randn(4, 2, 16)
    cos, sin = torch.rand(4, 8), torch.rand(4, 8)
    with pytest.raises(RuntimeError, match="exceeds D"):
        kernel_ops.rope_interleaved(torch.empty(4, 2, 8), x[..., :8], torch.rand(4, 5), torch.rand(4, 5), False, False)
    with pytest.raises(RuntimeError, match="out must be"):
        kernel_ops.rope_interleaved(torch.empty(4, 2, 15), x, cos, sin, False, False)
    with pytest.raises(RuntimeError, match="cos and sin"):
        kernel_ops.rope_interleaved(torch.empty(4, 2, 16), x, cos.t(), sin.t(), False, False)
