"""DeepSeek-V4 mHC CPU kernels (layers/cpu_kernels/hyper_connection.cpp) against the torch path of hc.py,
and the V4 model with and without them."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from openinfer import LLM, SamplingParams
from openinfer.models.deepseek_v4 import hc_kernels
from openinfer.models.deepseek_v4.hc import HyperConnection, fused_post_pre, fused_post_pre_torch

ROOT = Path(__file__).resolve().parents[1]
# (n, D): V4's hc_mult 4 at a real-ish width, an odd width (not a multiple of 16: the vector tails), n = 3 and 2
SHAPES = [(4, 1024), (4, 72), (3, 100), (2, 37)]
BF16_ULP = 2.0 ** -7  # relative spacing of bf16 values


def _hc(n: int, d: int, iters: int = 20, seed: int = 0) -> HyperConnection:
    torch.manual_seed(seed)
    hc = HyperConnection(n, d, sinkhorn_iters=iters, hc_eps=1e-6, norm_eps=1e-6)
    with torch.no_grad():
        hc.fn.normal_(0, 0.1), hc.base.normal_(0, 0.5), hc.scale.normal_(1, 0.3)
    return hc


def _streams(t: int, n: int, d: int, dtype: torch.dtype):
    X, y = torch.randn(t, n, d).to(dtype), torch.randn(t, d).to(dtype)
    post = 2 * torch.sigmoid(torch.randn(t, n))
    comb = torch.softmax(torch.randn(t, n, n), -1)
    return X, y, post, comb


def _assert_close_in(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    """fp32: float rounding. Reduced precision: at most one ulp apart, and only rarely (an fp32 difference of an
    ulp, from exp or a summation order, lands on the other side of a rounding boundary)."""
    assert got.dtype == want.dtype and got.shape == want.shape, name
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6, msg=name)
        return
    g, w = got.float(), want.float()
    torch.testing.assert_close(g, w, rtol=BF16_ULP, atol=1e-6, msg=name)
    assert (g != w).float().mean() < 2e-3, f"{name}: {(g != w).sum()} of {g.numel()} differ"


def _assert_columns_normalised(comb: torch.Tensor) -> None:
    # Sinkhorn ends on a column normalisation (rows only approach 1 as the iterations converge)
    torch.testing.assert_close(comb.sum(-2), torch.ones(comb.shape[:-1]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 7, 64])
@pytest.mark.parametrize("n, d", SHAPES)
def test_activate_matches_torch(kernel_ops, dtype, t, n, d):
    hc = _hc(n, d)
    X = torch.randn(t, n, d).to(dtype)
    mixes = torch.randn(t, (2 + n) * n) * 3
    with torch.inference_mode():
        got = hc_kernels.hc_activate(mixes, hc.base, hc.scale, X, hc.hc_eps, hc.sinkhorn_iters)
        want = hc._activate_torch(mixes, X)
    assert got is not None
    for name, g, w in zip(("x_in", "post", "comb"), got, want):
        _assert_close_in(g, w, dtype if name == "x_in" else torch.float32, name)
    _assert_columns_normalised(got[2])


@pytest.mark.parametrize("iters", [0, 1, 2, 5])
def test_activate_sinkhorn_iteration_counts_and_large_logits(kernel_ops, iters):
    # iters 0 and 1 both mean softmax + one column normalisation; logits ~ +-60 need the softmax's max shift
    hc = _hc(4, 16, iters=iters)
    X = torch.randn(5, 4, 16)
    mixes = torch.randn(5, 24) * 60
    with torch.inference_mode():
        got = hc_kernels.hc_activate(mixes, hc.base, hc.scale, X, hc.hc_eps, iters)
        want = hc._activate_torch(mixes, X)
    assert all(torch.isfinite(g).all() for g in got)
    for name, g, w in zip(("x_in", "post", "comb"), got, want):
        _assert_close_in(g, w, torch.float32, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 7, 64])
@pytest.mark.parametrize("n, d", SHAPES)
def test_post_pre_matches_torch(kernel_ops, dtype, t, n, d):
    nxt = _hc(n, d, seed=1)
    X, y, post, comb = _streams(t, n, d, dtype)
    with torch.inference_mode():
        got = hc_kernels.hc_post_pre(y, X, post, comb, nxt.fn, nxt.base, nxt.scale, nxt.norm_eps, nxt.hc_eps,
                                     nxt.sinkhorn_iters)
        want = fused_post_pre_torch(y, X, post, comb, nxt)
    assert got is not None
    # the mixes GEMV sums in another order than torch's BLAS: ~1e-6 relative on the mixes, which the
    # activation carries into pre/post/comb
    for name, g, w in zip(("new", "x_in", "post", "comb"), got, want):
        _assert_close_in(g, w, dtype if name in ("new", "x_in") else torch.float32, name)
    _assert_columns_normalised(got[3])


def test_post_pre_is_the_same_on_more_threads(kernel_ops):
    # tokens are split across threads, each token computed whole by one: the split must not change a bit
    nxt = _hc(4, 64)
    X, y, post, comb = _streams(64, 4, 64, torch.bfloat16)
    args = (y, X, post, comb, nxt.fn, nxt.base, nxt.scale, nxt.norm_eps, nxt.hc_eps, nxt.sinkhorn_iters)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        one = hc_kernels.hc_post_pre(*args)
        torch.set_num_threads(2)
        try:
            two = hc_kernels.hc_post_pre(*args)
        finally:
            torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_kernels_reject_bad_shapes(kernel_ops):
    nxt = _hc(4, 16)
    X, y, post, comb = _streams(3, 4, 16, torch.float32)
    with pytest.raises(RuntimeError, match="mixes must be"):
        kernel_ops.hc_activate(torch.zeros(3, 23), nxt.base, nxt.scale, X, 1e-6, 20)
    with pytest.raises(RuntimeError, match="y must be"):
        kernel_ops.hc_post_pre(y.bfloat16(), X, post, comb, nxt.fn, nxt.base, nxt.scale, 1e-6, 1e-6, 20)
    with pytest.raises(RuntimeError, match="fn must be"):
        kernel_ops.hc_post_pre(y, X, post, comb, nxt.fn[:, :32], nxt.base, nxt.scale, 1e-6, 1e-6, 20)


def test_torch_path_when_kernels_are_off_or_gradients_are_needed(monkeypatch):
    nxt = _hc(4, 16)
    X, y, post, comb = _streams(3, 4, 16, torch.float32)
    # streams that need a gradient take the torch path: the ops have no backward
    Xg = X.clone().requires_grad_()
    assert hc_kernels.hc_post_pre(y, Xg, post, comb, nxt.fn, nxt.base, nxt.scale, 1e-6, 1e-6, 20) is None
    fused_post_pre(y, Xg, post, comb, nxt)[1].sum().backward()
    assert Xg.grad is not None
    monkeypatch.setenv("OPENINFER_CPU_KERNELS", "0")
    with torch.inference_mode():
        assert hc_kernels.hc_activate(torch.zeros(3, 24), nxt.base, nxt.scale, X, 1e-6, 20) is None
        got = fused_post_pre(y, X, post, comb, nxt)
        want = fused_post_pre_torch(y, X, post, comb, nxt)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("make_v4", ROOT / "scripts" / "make_deepseek_v4_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_checkpoint(tmp_path_factory.mktemp("v4") / "tiny", "tiny", seed=0)


def _generate(ckpt: Path, dtype: str):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(6, 256, (n,), generator=g).tolist() for n in (5, 40, 23)]
    llm = LLM(str(ckpt), dtype=dtype, max_model_len=128, num_kv_blocks=64)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_v4_model_same_with_and_without_kernels(kernel_ops, ckpt, dtype, monkeypatch):
    calls = []
    real = hc_kernels.hc_post_pre
    monkeypatch.setattr(hc_kernels, "hc_post_pre", lambda *a: calls.append(real(*a)) or calls[-1])
    fast = _generate(ckpt, dtype)
    assert calls and all(c is not None for c in calls)  # the kernel ran, not the fallback
    calls.clear()
    # Only the mHC kernels off: the attention and MoE kernels round differently from their torch code as well
    # (fp32 accumulation where torch rounds to bf16), and in bf16 that alone can flip a near-tied greedy token;
    # the whole model with all kernels on and off is tests/test_v4_sparse_kernel.py's.
    monkeypatch.setattr(hc_kernels, "_ops", lambda *a: None)
    plain = _generate(ckpt, dtype)
    assert calls and all(c is None for c in calls)  # and now it did not
    for a, b in zip(fast, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # bf16: the kernel moves fp32 roundings by an ulp, which bf16 activations carry through the layers;
        # on this checkpoint that is 0.034 at most, while bf16 itself is up to 0.5 off the fp32 model
        lp_tol = 1e-4 if dtype == "float32" else 5e-2
        for j, t in enumerate(a.outputs[0].token_ids):
            assert abs(a.outputs[0].logprobs[j][t] - b.outputs[0].logprobs[j][t]) < lp_tol


# The kernel tests above run again on the x86-64-v3 (AVX2) build: tests/test_avx2_variant.py.
