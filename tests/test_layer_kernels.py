"""The fused per-layer CPU kernels (cpu_kernels/layer_ops.cpp) against the torch code they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openinfer.layers import cpu_ops
from openinfer.layers.activation import SiluAndMul
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import RotaryEmbedding, apply_neox

# fp32 agrees to rounding; bf16 to about one last-bit step where fp32 rounding lands on a bf16 tie (relative
# 2^-8 of the value) — compared relative to each tensor's scale.
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3}
# one row; a width off the 16-lane vectors; one off the 8-lane ones too; enough rows to go parallel
SHAPES = [(1, 64), (7, 1000), (5, 1003), (300, 1024)]


def _close(a: torch.Tensor, b: torch.Tensor, dtype) -> None:
    a, b = a.float(), b.float()
    err = ((a - b).abs() / (b.abs() + 1)).max().item()
    assert err <= TOL[dtype], err


def _torch_norm(x, w, eps):  # norm.py's torch path: fp32 norm, cast, then the weight in the activation dtype
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_kernel_add_rms_norm(kernel_ops, dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[1], generator=gen)).to(dtype)
    want_r = x + r
    want = _torch_norm(want_r, w, 1e-6)
    assert cpu_ops.add_rms_norm_(x, r, w, 1e-6)
    assert torch.equal(r, want_r)  # the residual add rounds exactly like torch's
    _close(x, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_kernel_rms_norm_strided_rows(kernel_ops, dtype, shape):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(shape[0], shape[1] + 24, generator=gen).to(dtype)
    x = wide[:, 8:8 + shape[1]]  # rows of a wider tensor, as a split of a fused projection gives
    w = (1 + 0.1 * torch.randn(shape[1], generator=gen)).to(dtype)
    before = wide.clone()
    out = cpu_ops.rms_norm(x, w, 1e-5)
    assert out is not None and out.is_contiguous()
    _close(out, _torch_norm(x, w, 1e-5), dtype)
    assert torch.equal(wide, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_kernel_silu_and_mul(kernel_ops, dtype, shape):
    gen = torch.Generator().manual_seed(2)
    x = (4 * torch.randn(shape[0], 2 * shape[1], generator=gen)).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # far tails of the sigmoid, and zero
    d = shape[1]
    out = cpu_ops.silu_and_mul(x)
    _close(out, F.silu(x[:, :d]) * x[:, d:], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hk, d, rot", [(4, 2, 64, 64), (8, 8, 80, 80), (4, 1, 64, 32)])
def test_layer_kernel_rotary_cache_write(kernel_ops, dtype, hq, hk, d, rot):
    gen = torch.Generator().manual_seed(3)
    t, num_blocks, bs = 37, 12, 16
    rope = RotaryEmbedding(rot, {"rope_theta": 10000.0, "rope_type": "default"}, 4096)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (t,), generator=gen)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
    kc = torch.randn(num_blocks, bs, hk, d, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, bs, hk, d, generator=gen).to(dtype)
    # the torch path: rotate q|k as one tensor (llama.py), then index_copy_ into the caches (attention.py)
    qk = apply_neox(qkv[:, :(hq + hk) * d].view(t, hq + hk, d), *rope.cos_sin(positions))
    want_k, want_v = kc.clone().view(-1, hk, d), vc.clone().view(-1, hk, d)
    want_k.index_copy_(0, slots, qk[:, hq:])
    want_v.index_copy_(0, slots, qkv[:, (hq + hk) * d:].view(t, hk, d))
    v_before = qkv[:, (hq + hk) * d:].clone()

    assert cpu_ops.rotary_cache_write_(qkv, positions, rope.cos, rope.sin, kc, vc, slots, hq, hk, d, rot)
    _close(qkv[:, :(hq + hk) * d].view(t, hq + hk, d), qk, dtype)
    assert torch.equal(qkv[:, (hq + hk) * d:], v_before)
    _close(kc.view(-1, hk, d), want_k, dtype)
    assert torch.equal(vc.view(-1, hk, d), want_v)
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(kc.view(-1, hk, d)[untouched], want_k[untouched])


def test_layer_kernel_rotary_rejects_out_of_range_indices(kernel_ops):
    rope = RotaryEmbedding(64, {"rope_theta": 10000.0, "rope_type": "default"}, 128)
    qkv = torch.randn(2, 3 * 64)
    kc, vc = torch.zeros(4, 16, 1, 64), torch.zeros(4, 16, 1, 64)
    with pytest.raises(RuntimeError, match="position 128 outside"):
        cpu_ops.rotary_cache_write_(qkv, torch.tensor([0, 128]), rope.cos, rope.sin, kc, vc,
                                    torch.tensor([0, 1]), 1, 1, 64, 64)
    with pytest.raises(RuntimeError, match="slot 64 outside"):
        cpu_ops.rotary_cache_write_(qkv, torch.tensor([0, 1]), rope.cos, rope.sin, kc, vc,
                                    torch.tensor([0, 64]), 1, 1, 64, 64)
    assert not kc.any() and not vc.any()  # checked before anything is written


def test_layer_kernel_modules_take_the_kernel_and_fall_back(kernel_ops, monkeypatch):
    """RMSNorm / SiluAndMul call the kernels on CPU, and give the same values on the torch path."""
    gen = torch.Generator().manual_seed(4)
    norm, act = RMSNorm(256), SiluAndMul()
    x, r, h = torch.randn(9, 256, generator=gen), torch.randn(9, 256, generator=gen), torch.randn(9, 64, generator=gen)

    def run():
        a, res = norm(x.clone(), r.clone())
        return norm(x), a, res, act(h)

    used = []
    for name in ("rms_norm", "add_rms_norm_", "silu_and_mul"):
        real = getattr(cpu_ops, name)
        monkeypatch.setattr(cpu_ops, name, lambda *a, _r=real, _n=name: used.append((_n, _r(*a))) or used[-1][1])
    fast = run()
    assert [n for n, res in used if res is not None and res is not False] == ["add_rms_norm_", "rms_norm",
                                                                            "silu_and_mul"]
    used.clear()
    monkeypatch.setenv("OPENINFER_CPU_KERNELS", "0")
    slow = run()
    assert len(used) == 3 and all(res is None or res is False for _, res in used)  # each wrapper declined
    for f, s in zip(fast, slow):
        _close(f, s, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layer_kernel_argmax_rows(kernel_ops, dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 1003, generator=gen).round().to(dtype)  # rounded: many tied maxima; 1003 = lanes + tail
    x[1, 500:] = float("inf")  # first of many maxima
    x[2] = float("-inf")  # nothing but -inf: index 0
    x[3, 7] = x[3, 900] = float("nan")  # NaN wins, first NaN
    x[4, 1002] = 100.0  # maximum in the scalar tail
    x[5, 15] = x[5, 16] = 100.0  # tie across two lanes' first elements
    want = x.max(dim=-1).indices
    assert torch.equal(cpu_ops.argmax_rows(x), want)
    assert torch.equal(want, x.float().argmax(dim=-1))  # the index greedy decoding has always taken
    strided = torch.randn(6, 2048, generator=gen).to(dtype)[:, 100:1100]
    assert torch.equal(cpu_ops.argmax_rows(strided), strided.max(dim=-1).indices)
    # vocabulary-sized rows (512-wide blocks, then the scan of the winning block for the first index):
    # the maximum in the first block, in the tail, tied across blocks / within a block / between a block and the
    # tail, an all -inf row, a NaN
    wide = torch.randn(8, 32003, generator=gen).to(dtype)
    wide[0, 5] = wide[1, 16 + 3] = wide[2, 32001] = 50.0
    wide[3, 40] = wide[3, 31000] = 50.0
    wide[4, 17] = wide[4, 3] = 50.0
    wide[5] = float("-inf")
    wide[6, 20000] = float("nan")
    wide[7, 100] = wide[7, 32002] = 50.0  # tied between a whole block and the tail: the block's index
    assert torch.equal(cpu_ops.argmax_rows(wide), wide.max(dim=-1).indices)
    assert cpu_ops.argmax_rows(wide).tolist() == [5, 19, 32001, 40, 3, 0, 20000, 100]


def test_layer_kernel_vector_lanes_follow_the_build(kernel_ops):
    """vec.h's vectors are one register wide: 16 lanes on AVX-512 builds, 8 on every other (without AVX-512, GCC
    lowers 16-lane compares and selects lane by lane through the stack)."""
    import os
    import platform

    from openinfer.platform import cpu_info

    cflags = os.environ.get("OPENINFER_KERNEL_CFLAGS", "")
    if "-march=" in cflags and "-march=x86-64-v3" not in cflags:
        pytest.skip(f"a build for {cflags!r}: lanes not predicted here")
    native512 = platform.machine() in ("x86_64", "AMD64") and "avx512f" in cpu_info()[1]
    want = 16 if native512 and "-march=x86-64-v3" not in cflags else 8
    assert kernel_ops.vector_lanes() == want
