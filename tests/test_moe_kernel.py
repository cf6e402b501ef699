"""The MoE kernels (cpu_kernels/moe_ops.cpp: expert choice, clamped SwiGLU, weighted combine) against the torch code
they replace, and the MoE layer with the kernels on and off."""
from __future__ import annotations

import pytest
import torch

from openinfer.layers import cpu_ops
from openinfer.layers.deepseek_moe import DeepseekMoE, RouterConfig, _select, route
from openinfer.layers.moe import combine_experts, fused_experts, pack_experts, reference_experts, torch_swiglu


def _kernels(monkeypatch, on: bool) -> None:
    monkeypatch.setenv("OPENINFER_CPU_KERNELS", "1" if on else "0")


@pytest.mark.parametrize("e, k, n_group, topk_group", [(16, 4, 1, 1), (16, 4, 8, 4), (64, 6, 8, 3), (7, 7, 1, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_moe_select_matches_torch_including_ties(kernel_ops, e, k, n_group, topk_group, with_bias):
    """Scores rounded to a coarse grid, so many experts and groups tie: the kernel must break every tie the way
    the stable descending sort does (lowest index first)."""
    gen = torch.Generator().manual_seed(e + k + n_group)
    scores = (torch.rand(300, e, generator=gen) * 8).round() / 8
    bias = (torch.rand(e, generator=gen) * 4).round() / 8 if with_bias else None
    cfg = RouterConfig(n_routed_experts=e, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group)
    got = cpu_ops.moe_select(scores, bias, k, n_group, topk_group)
    assert torch.equal(got, _select(scores, cfg, bias))


def test_route_same_bits_with_and_without_kernels(kernel_ops, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(33, 16, generator=gen)
    bias = torch.randn(16, generator=gen) * 0.1
    cfg = RouterConfig(n_routed_experts=16, num_experts_per_tok=4, scoring_func="sqrtsoftplus", n_group=4,
                       topk_group=2, routed_scaling_factor=1.5)
    outs = []
    for on in (True, False):
        _kernels(monkeypatch, on)
        outs.append(route(logits, cfg, bias))
    assert torch.equal(outs[0][1], outs[1][1]) and torch.equal(outs[0][0], outs[1][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("shape", [(1, 64), (5, 2 * 37), (40, 512)])
def test_swiglu_kernel_matches_torch(kernel_ops, dtype, limit, shape):
    gen = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(shape, generator=gen) * 2).to(dtype)
    x[0, 0] = float("nan")  # NaN passes through the clamp, as in torch
    got, want = cpu_ops.swiglu(x, limit).float(), torch_swiglu(x, limit).float()
    assert got[0, 0].isnan() and want[0, 0].isnan()
    got[0, 0] = want[0, 0] = 0
    # fp32: the kernel's exp differs from torch's by an ulp; bf16: then at most one bf16 step where that lands
    # on a rounding boundary
    tol = 2e-6 if dtype == torch.float32 else 8e-3
    assert ((got - want).abs() / (want.abs() + 1)).max() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_out", [False, True])
def test_moe_combine_same_bits_as_torch(kernel_ops, monkeypatch, dtype, with_out):
    gen = torch.Generator().manual_seed(9)
    t, k, e, h = 37, 4, 16, 72
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    order = torch.argsort(ids.reshape(-1), stable=True)
    y = torch.randn(t * k, h, generator=gen).to(dtype)
    w = torch.rand(t, k, generator=gen)
    base = torch.randn(t, h, generator=gen).to(dtype)
    outs = []
    for on in (True, False):
        _kernels(monkeypatch, on)
        outs.append(combine_experts(y, order, w, base.clone() if with_out else None))
    assert torch.equal(outs[0], outs[1])
    # and what it replaces: weighted scatter in y's dtype, then + the shared output
    ref = torch.zeros(t, h, dtype=dtype).index_add_(0, order // k, y * w.reshape(-1)[order, None].to(dtype))
    assert torch.equal(outs[0], ref + base if with_out else ref)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("limit", [None, 1.0])
def test_fused_experts_with_shared_out_matches_reference(kernel_ops, dtype, tol, limit):
    gen = torch.Generator().manual_seed(2)
    t, h, inter, e, k = 21, 64, 48, 8, 3
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) * 0.2).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    shared = torch.randn(t, h, generator=gen).to(dtype)
    want = reference_experts(x, w13, w2, w, ids, limit).float() + shared.float()
    packed = pack_experts(w13, w2) if dtype == torch.float32 else None
    got = fused_experts(x, w13, w2, w, ids, limit, packed=packed, out=shared.clone()).float()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_deepseek_moe_layer_same_with_and_without_kernels(kernel_ops, monkeypatch):
    """Routing, SwiGLU and combine each give the torch path's bits except the SwiGLU's exp (an ulp): fp32 layer
    outputs agree to rounding, and every token's experts are the same."""
    gen = torch.Generator().manual_seed(8)
    cfg = RouterConfig(n_routed_experts=16, num_experts_per_tok=4, n_group=8, topk_group=4,
                       routed_scaling_factor=2.5)
    layer = DeepseekMoE(64, 32, 1, cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    x = torch.randn(50, 64, generator=gen)
    outs = []
    for on in (True, False):
        _kernels(monkeypatch, on)
        with torch.no_grad():
            outs.append((layer(x), layer.gate(x)[1]))
    assert torch.equal(outs[0][1], outs[1][1])
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
