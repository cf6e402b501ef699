"""The small-M dense linear kernel (cpu_kernels/gemv.cpp) against torch, its dispatch from ``Linear``, the torch path
with the kernels off, and the engine's greedy tokens with the kernel on and off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_dense_checkpoint, random_prompts

from openinfer import LLM, SamplingParams
from openinfer.layers import cpu_ops, linear
from openinfer.layers.linear import Linear

# (M, N, K): M 1, 2, 3, 8 and a larger odd M; N not a multiple of the 4-row block, K not a multiple of the vector
# width (8 / 16 floats) nor of the bf16 pair run (16 / 32), plus aligned shapes and a K tail after full runs.
SHAPES = [(1, 7, 37), (1, 64, 256), (2, 13, 100), (3, 33, 1030), (8, 40, 300), (8, 5, 16), (21, 9, 70), (1, 3, 5)]


def _data(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype),
            torch.randn(n, generator=g).to(dtype))


def _tol(dtype, exact):
    scale = max(1.0, float(exact.abs().max()))
    return 1e-5 * scale if dtype == torch.float32 else 1e-2 * scale  # bf16: one rounding of the output


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_torch(kernel_ops, dtype, with_bias):
    for i, (m, n, k) in enumerate(SHAPES):
        x, w, b = _data(m, n, k, dtype, i)
        bias = b if with_bias else None
        y = cpu_ops.dense_gemv(x, w, bias)
        assert y is not None and y.dtype == dtype and y.shape == (m, n)
        exact = x.double() @ w.double().t() + (b.double() if with_bias else 0)
        assert (y.double() - exact).abs().max() <= _tol(dtype, exact), (m, n, k)
        ref = F.linear(x, w, bias)
        assert (y.double() - ref.double()).abs().max() <= 2 * _tol(dtype, exact), (m, n, k)
        if dtype == torch.bfloat16:  # fp32 accumulation rounded once: within half a bf16 step of the exact value
            err = (y.double() - exact).abs()
            assert (err <= exact.abs() * 2 ** -8 + 1e-4 * float(exact.abs().max())).all(), (m, n, k)
        prev = torch.get_num_threads()
        torch.set_num_threads(2)
        try:  # each output is one thread's dot product: the split over threads changes no bit
            assert torch.equal(cpu_ops.dense_gemv(x, w, bias), y)
        finally:
            torch.set_num_threads(prev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_nan_inf_propagate_like_torch(kernel_ops, dtype):
    m, n, k = 3, 10, 45
    x, w, _ = _data(m, n, k, dtype, 7)
    x[0, 3] = float("nan")  # in the vector part
    x[1, 44] = float("inf")  # in the scalar K tail
    x[2, 20] = -float("inf")
    y = cpu_ops.dense_gemv(x, w, None).float()
    ref = (x.float() @ w.float().t())
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.equal(torch.isposinf(y), torch.isposinf(ref)) and torch.equal(torch.isneginf(y), torch.isneginf(ref))
    assert torch.isnan(y[0]).all() and torch.isinf(y[1]).all() and torch.isinf(y[2]).all()


def test_gemv_rejects_what_it_cannot_take(kernel_ops):
    x, w, b = _data(2, 8, 16, torch.float32, 0)
    assert cpu_ops.dense_gemv(x.bfloat16(), w, None) is None  # dtype mix: the caller runs F.linear
    assert cpu_ops.dense_gemv(x, w.t().contiguous().t(), None) is None  # not row-major
    assert cpu_ops.dense_gemv(x.half(), w.half(), None) is None
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        kernel_ops.dense_gemv(torch.empty(2, 8), x[:, :15], w, None)


def _spy(monkeypatch):
    calls = []
    real = cpu_ops.dense_gemv

    def spy(x, w, b):
        y = real(x, w, b)
        calls.append(y is not None)
        return y

    monkeypatch.setattr(cpu_ops, "dense_gemv", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_dispatch_and_kernels_off(kernel_ops, monkeypatch, dtype):
    """Unpacked weights run the kernel at M <= GEMV_MAX_M (bf16 without native bf16: at every M); leading dims pass
    through; with OPENINFER_CPU_KERNELS=0 or OPENINFER_CPU_GEMV=0 the torch path gives the same values."""
    from openinfer.platform import cpu_has_fast_bf16

    torch.manual_seed(0)
    lin = Linear(100, 37, bias=True).to(dtype).requires_grad_(False)
    calls = _spy(monkeypatch)
    for m in (1, 3, linear.GEMV_MAX_M, 20):
        x = torch.randn(m, 100).to(dtype)
        calls.clear()
        y = lin(x)
        every_m = dtype == torch.bfloat16 and not cpu_has_fast_bf16()
        assert calls == ([True] if m <= linear.GEMV_MAX_M or every_m else []), m
        with monkeypatch.context() as mp:
            mp.setenv("OPENINFER_CPU_KERNELS", "0")
            off = lin(x)
        with monkeypatch.context() as mp:
            mp.setenv("OPENINFER_CPU_GEMV", "0")
            calls.clear()
            assert torch.equal(lin(x), off) and calls == []
        exact = x.double() @ lin.weight.double().t() + lin.bias.double()
        assert (y.double() - off.double()).abs().max() <= 2 * _tol(dtype, exact), m
    x3 = torch.randn(2, 3, 100).to(dtype)
    assert torch.equal(lin(x3), lin(x3.reshape(6, 100)).reshape(2, 3, 37))
    lin.weight.requires_grad_(True)  # training: the kernel has no backward, F.linear runs
    calls.clear()
    assert lin(torch.randn(1, 100).to(dtype)).requires_grad and calls == []


def _greedy(path, monkeypatch, gemv, **kw):
    with monkeypatch.context() as mp:
        mp.setenv("OPENINFER_CPU_GEMV", "1" if gemv else "0")
        llm = LLM(model=str(path), num_kv_blocks=64, **kw)
        prompts = random_prompts(3, [5, 20, 9], vocab_size=100)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)  # top-2: the margin
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return outs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_greedy_same_with_gemv_on_and_off(tmp_path, monkeypatch, kernel_ops, dtype):
    """Row-major weights (OPENINFER_CPU_PREPACK=0, OPENINFER_CPU_PANELS=0): fp32 in the low-latency mode, bf16 as a CPU
    without native bf16 runs it with the panels off (its bf16 is never prepacked for oneDNN; a CPU with native bf16
    prepacks bf16 unless OPENINFER_CPU_PREPACK=0, and the kernel then never runs). The kernel changes only summation
    order.

    Bounds. fp32: each output is an fp32 dot product in another order (~1e-6 relative), logprobs within 1e-4 and the
    same tokens (this model's top-2 logprob margins are >= ~0.007). bf16: both paths accumulate in fp32 and round each
    linear's output to bf16 once; they differ where the two fp32 sums straddle a rounding boundary, by one bf16 step
    (2^-7 relative) on that element, and the later layers (bf16 activations, norms, attention) carry it to the
    logits, which are bf16 themselves: one step is 2^-6 = 0.016 for a logit in [2, 4). Budget: 5e-2 on the chosen
    token's logprob (~3 steps; 0.015 seen on the AVX-512 host, whose oneDNN runs the rows the kernel does not). With
    every logprob within 5e-2 of the other path's, the argmax can differ only where the reference's top-2 margin is
    under 2 x 5e-2; bf16 logits tie exactly (margin 0 or one step) at some greedy steps of this tiny model. So in bf16
    the tokens must agree except at such a near-tie, and after the first position where they part (their contexts
    differ from there) nothing is compared; every position before it is, logprobs included."""
    monkeypatch.setenv("OPENINFER_CPU_PREPACK", "0")
    monkeypatch.setenv("OPENINFER_CPU_PANELS", "0")
    path = make_dense_checkpoint(tmp_path / "m", vocab_size=128, hidden_size=128, intermediate_size=256)
    calls = _spy(monkeypatch)
    fast = _greedy(path, monkeypatch, True, dtype=dtype)
    assert calls and all(calls)
    calls.clear()
    ref = _greedy(path, monkeypatch, False, dtype=dtype)
    assert calls == []  # the reference ran without the kernel
    lp_tol = 1e-4 if dtype == "float32" else 5e-2
    for a, b in zip(fast, ref):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert len(ta) == len(tb)
        for j, (t, u) in enumerate(zip(ta, tb)):
            if t != u:
                top = sorted((float(v) for v in b.outputs[0].logprobs[j].values()), reverse=True)
                assert dtype == "bfloat16" and top[0] - top[1] < 2 * lp_tol, (j, ta, tb, top[:2])
                break
            assert abs(a.outputs[0].logprobs[j][t] - b.outputs[0].logprobs[j][t]) < lp_tol, (j, ta)


# The kernel tests above run again on the x86-64-v3 (AVX2) build: tests/test_avx2_variant.py.
