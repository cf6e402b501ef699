"""--quantization w4a8: int4 weights in blocks of 4 rows, int8 activations per token, integer dot products
(cpu_kernels/w4a8_gemm.cpp) -- the layout, the kernel against exact integer arithmetic and against the torch
reference, its errors, and the engine with kernels on and off."""
from __future__ import annotations

import pytest
import torch
from helpers import engine_model, make_dense_checkpoint, random_prompts

from openinfer import LLM, SamplingParams
from openinfer.engine_args import EngineArgs
from openinfer.layers import cpu_ops
from openinfer.layers.linear import Linear
from openinfer.layers.quant_linear import (QuantizedWeight, block_rows, quantize_activations, quantize_int4,
                                           unblock_rows, w4a8_reference)

needs_kernels = pytest.mark.usefixtures("kernel_ops")  # a failed build fails these tests (conftest.py)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _exact(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """fp64 y from the same quantised integers, written independently of both paths: x quantised by torch, the
    weight's integers from ``dequantize`` / scale, every group's dot in int64."""
    n, k = qw.shape
    xq, xs = quantize_activations(x.float())
    s = qw.scales.double().repeat_interleave(qw.group, dim=1)[:, :k]
    wq = torch.round(qw.dequantize().double() / s).to(torch.int64)  # the integers q in [-7, 7]
    y = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for g in range(qw.scales.shape[1]):
        cols = slice(g * qw.group, min(k, (g + 1) * qw.group))
        y += (xq[:, cols].to(torch.int64) @ wq[:, cols].t()).double() * qw.scales[:, g].double()
    return y * xs.double()[:, None]


def test_layout_round_trip_and_padding():
    w = torch.randn(9, 100, generator=_gen(0))
    q, s = quantize_int4(w, 128, pad=64)
    assert q.shape == (9, 64) and s.shape == (9, 1)  # K 100 -> 128 columns
    b = block_rows(q)
    assert b.shape == (12, 64) and b.is_contiguous()  # 9 rows -> 3 blocks of 4
    assert torch.equal(unblock_rows(b, 9), q)
    # block 0, columns 64-127 (step 1): the 4 rows' 32 bytes in turn, after step 0's 4 x 32
    assert torch.equal(b.view(3, 256)[0, 128:160], q[0, 32:64]) and torch.equal(b.view(3, 256)[0, 160:192], q[1, 32:64])
    assert (b.view(3, 2, 4, 32)[2, :, 1:] == 0x88).all()  # rows 9-11: nibble 8 everywhere, q = 0
    qw = QuantizedWeight.quantize(w, "w4a8")
    assert torch.equal(qw.int4_rows(), q) and torch.equal(qw.qweight, b)
    assert torch.equal(qw.dequantize(), QuantizedWeight("int4", q, s, (9, 100), torch.float32, 128).dequantize())
    with pytest.raises(ValueError, match="multiple of 64"):
        QuantizedWeight.quantize(w, "w4a8", group=96)


@needs_kernels
@pytest.mark.parametrize("group", [64, 256, 512])
def test_kernel_integer_path_is_exact(group):
    """Scales of exactly 1 on both sides (integer weights with 7 in every group, integer activations with 127 in
    every row, halves among them to test round-half-even), so y is the integer dot product and must be exact. Eight
    tokens take the 4-token prefill path twice; at group 256 its int16 group sums meet their bound (a row of 7s
    against tokens of +-127: 4 steps x 2 x 2 x 15 x 127 = 30480 per lane), at 512 the kernel widens every step."""
    n, k = 10, 1024
    wi = torch.randint(-7, 8, (n, k), generator=_gen(1))
    wi[:, ::group] = 7
    wi[0] = 7
    x = torch.randint(-126, 127, (8, k), generator=_gen(2)).float()
    x[:, 3] = 127.0
    x[:, 10:20] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5, 4.5])
    x[4] = 0.0  # an all-zero token: scale 1, output 0
    x[5], x[6] = 127.0, -127.0
    qw = QuantizedWeight.quantize(wi.float(), "w4a8", group)
    assert (qw.scales == 1).all()
    xq, xs = quantize_activations(x)
    assert (xs[:4] == 1).all() and xq[0, 10:20].tolist() == [0, 2, 2, 0, -2, -2, 126, -126, 4, 4]
    want = (xq.to(torch.int64) @ wi.t().to(torch.int64)).float()
    assert want[5, 0] == 127 * 7 * k
    assert torch.equal(qw.matmul(x), want)
    assert torch.equal(qw.matmul(x[:3]), want[:3])  # the decode-sized paths (pairs, single tokens) alike


@needs_kernels
@pytest.mark.parametrize("m,n,k,group", [(1, 1, 37, 64), (1, 37, 100, 128), (2, 4, 64, 64), (3, 64, 1024, 128),
                                         (5, 9, 2816, 128), (23, 9, 2816, 128), (40, 130, 700, 192),
                                         (7, 6, 130, 256)])
def test_kernel_matches_exact_and_reference(monkeypatch, m, n, k, group):
    """23 tokens at K 2816 span three of the kernel's token tiles (8 tokens of 32 KB), the last one 4 + 2 + 1."""
    w = torch.randn(n, k, generator=_gen(n + k))
    w[n // 2] = 0.0  # an all-zero output row
    qw = QuantizedWeight.quantize(w, "w4a8", group)
    x = torch.randn(m, k, generator=_gen(m)) * 3
    bias = torch.randn(n, generator=_gen(5))
    fast = qw.matmul(x, bias)
    with monkeypatch.context() as mp:
        mp.setenv("OPENINFER_CPU_KERNELS", "0")
        ref = qw.matmul(x, bias)
    exact = _exact(x, qw) + bias.double()
    tol = 2e-6 * float(exact.abs().max())
    assert fast.shape == (m, n) and fast.dtype == torch.float32
    assert (fast.double() - exact).abs().max() <= tol and (ref.double() - exact).abs().max() <= tol
    assert torch.equal(fast[:, n // 2], bias[n // 2].expand(m))
    # leading dims pass through, bf16 activations come back in bf16
    x3 = x.reshape(1, m, k)
    assert torch.equal(qw.matmul(x3, bias), fast.reshape(1, m, n))
    assert torch.equal(qw.matmul(x.bfloat16(), bias), QuantizedWeight.matmul(qw, x.bfloat16().float(), bias).bfloat16())


@needs_kernels
def test_kernel_errors_name_the_operand():
    ops = cpu_ops.get_ops()
    qw = QuantizedWeight.quantize(torch.randn(8, 128), "w4a8")
    x, y = torch.randn(2, 128), torch.empty(2, 8)
    with pytest.raises(RuntimeError, match="blocks of 4 rows"):
        ops.w4a8_linear(y, x, qw.int4_rows()[:6].contiguous(), qw.scales[:6].contiguous(), 128, None)
    with pytest.raises(RuntimeError, match="group must be a positive multiple of 64"):
        ops.w4a8_linear(y, x, qw.qweight, qw.scales, 96, None)
    with pytest.raises(RuntimeError, match="x must be contiguous fp32"):
        ops.w4a8_linear(y, torch.randn(2, 100), qw.qweight, qw.scales, 128, None)
    with pytest.raises(RuntimeError, match="scales must be contiguous fp32"):
        ops.w4a8_linear(y, x, qw.qweight, torch.ones(12, 1), 128, None)
    with pytest.raises(RuntimeError, match="y must be contiguous fp32"):
        ops.w4a8_linear(torch.empty(2, 7), x, qw.qweight, qw.scales, 128, None)
    ops.w4a8_linear(torch.empty(0, 8), torch.empty(0, 128), qw.qweight, qw.scales, 128, None)  # no tokens


def test_reference_matches_exact():
    """The torch path alone (what a GPU or OPENINFER_CPU_KERNELS=0 runs)."""
    qw = QuantizedWeight.quantize(torch.randn(13, 200, generator=_gen(3)), "w4a8")
    x = torch.randn(4, 256, generator=_gen(4))
    x[:, 200:] = 0.0  # the padded columns
    y = w4a8_reference(x, qw.int4_rows(), qw.scales, qw.group, None)
    exact = _exact(x[:, :200], qw)
    assert (y.double() - exact).abs().max() <= 2e-6 * float(exact.abs().max())


def _greedy(path, kernels, monkeypatch, **kw):
    # fp32 whatever the host ("auto" is bf16 on native-bf16 CPUs): kernel and reference form the same exact int32
    # group sums and differ only in the fp32 sum over groups (the 1e-4 logprob bound below); a bf16 model rounds
    # every linear's and norm's output to 8 bits, which moved this model's logprobs by up to 0.043 between kernels on
    # and off (AVX-512 host) and its bf16 logits tie exactly (top-2 margin one bf16 step) at some greedy steps.
    kw.setdefault("dtype", "float32")
    with monkeypatch.context() as mp:
        mp.setenv("OPENINFER_CPU_KERNELS", "1" if kernels else "0")
        llm = LLM(model=str(path), quantization="w4a8", num_kv_blocks=64, **kw)
        prompts = random_prompts(3, [5, 70, 9], vocab_size=100)
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        model = engine_model(llm)
        llm.engine.shutdown()
    toks = [o.outputs[0].token_ids for o in outs]
    lps = torch.tensor([float(d[t]) for o in outs for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
    return toks, lps, model


@needs_kernels
def test_llama_greedy_same_with_kernels_on_and_off(tmp_path, monkeypatch):
    path = make_dense_checkpoint(tmp_path / "m", vocab_size=128, hidden_size=128, intermediate_size=256)
    fast, fast_lps, model = _greedy(path, True, monkeypatch)
    quantised = [m for m in model.modules() if isinstance(m, Linear) and m._quant is not None]
    assert len(quantised) == 2 * 4 + 1 and all(m._quant.method == "w4a8" for m in quantised)
    ref, ref_lps, _ = _greedy(path, False, monkeypatch)
    assert fast == ref
    torch.testing.assert_close(fast_lps, ref_lps, rtol=0, atol=1e-4)


@needs_kernels
def test_deepseek_v3_experts_w4a8_greedy_same_with_kernels_on_and_off(tmp_path, monkeypatch):
    from test_deepseek_v3 import make_hf_v3

    path = make_hf_v3(tmp_path / "v3")
    fast, _, model = _greedy(path, True, monkeypatch)
    experts = [m for m in model.modules() if type(m).__name__ == "DeepseekExperts"]
    assert experts and all(w.method == "w4a8" for m in experts for ws in m._packed for w in ws)
    ref, _, _ = _greedy(path, False, monkeypatch)
    assert fast == ref


def test_resident_bytes_and_flag(tmp_path):
    path = make_dense_checkpoint(tmp_path / "m", vocab_size=128, hidden_size=128, intermediate_size=256)
    assert EngineArgs(model=str(path), quantization="w4a8").create_engine_config().model.quantization == "w4a8"
    sizes = {}
    for quant in ("int4", "w4a8"):
        model = engine_model(LLM(model=str(path), quantization=quant, num_kv_blocks=16))
        sizes[quant] = sum(m._quant.nbytes for m in model.modules() if isinstance(m, Linear) and m._quant is not None)
    assert sizes["w4a8"] == sizes["int4"]  # the same nibbles and scales, only their order differs
