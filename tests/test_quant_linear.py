"""--quantization int8 / int4: the packing, the C++ kernel (cpu_kernels/lowbit_gemm.cpp) against the torch reference
path, the engine's greedy tokens with kernels on and off (Llama and DeepSeek-V3 with quantised experts), resident
weight bytes, and the config errors."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import engine_model, make_dense_checkpoint, random_prompts, require_kernels

from openinfer import LLM, SamplingParams
from openinfer.engine_args import EngineArgs
from openinfer.layers import cpu_ops
from openinfer.layers.linear import Linear, weight_bytes
from openinfer.layers import quant_linear
from openinfer.layers.quant_linear import LOWBIT_DEQUANT_ROWS, QuantizedWeight, quantize_int4, quantize_int8

# (M, N, K); M >= LOWBIT_DEQUANT_ROWS[method] (70 for both) runs the decoded-matrix path
SHAPES = [(1, 7, 37), (1, 64, 256), (1, 5, 50), (3, 13, 100), (5, 9, 16), (2, 33, 130), (8, 40, 300), (70, 41, 130)]


def _weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[n // 2] = 0.0  # an all-zero output row
    return w


def test_quantize_round_trip_and_zero_rows():
    w = _weight(9, 100)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (9,) and torch.isfinite(s).all() and (s > 0).all()
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-6).all()
    assert (q[4] == 0).all()
    group = 32
    p, s4 = quantize_int4(w, group)
    assert p.dtype == torch.uint8 and p.shape == (9, 56) and s4.shape == (9, 4)  # K 100 -> 112 columns, 4 groups
    assert torch.isfinite(s4).all() and (s4 > 0).all()
    qw = QuantizedWeight.quantize(w, "int4", group)
    err = (qw.dequantize() - w).abs()
    bound = s4.repeat_interleave(group, 1)[:, :100] / 2 + 1e-6
    assert (err <= bound).all() and (qw.dequantize()[4] == 0).all()
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_int4(w, 24)


@pytest.mark.parametrize("method,group", [("int8", 0), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowbit_kernel_matches_torch_reference(monkeypatch, method, group, dtype):
    require_kernels()
    for i, (m, n, k) in enumerate(SHAPES):
        qw = QuantizedWeight.quantize(_weight(n, k, i), method, group or 128)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + i)).to(dtype)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(200 + i)).to(dtype)
        fast = qw.matmul(x, bias)
        with monkeypatch.context() as mp:
            mp.setenv("OPENINFER_CPU_KERNELS", "0")
            ref = qw.matmul(x, bias)
        exact = x.float() @ qw.dequantize().t() + bias.float()
        assert fast.dtype == dtype and fast.shape == (m, n)
        tol = 1e-4 * max(1.0, float(exact.abs().max())) if dtype == torch.float32 else 2e-2 * float(exact.abs().max())
        assert (fast.float() - ref.float()).abs().max() <= tol, (method, m, n, k)
        assert (fast.float() - exact).abs().max() <= tol, (method, m, n, k)
        assert torch.isfinite(fast.float()).all() and (fast[:, n // 2].float() == bias[n // 2].float()).all()
    x3 = torch.randn(2, 3, k).to(dtype)  # leading dims pass through: [B, T, K] -> [B, T, N]
    assert torch.equal(qw.matmul(x3), qw.matmul(x3.reshape(6, k)).reshape(2, 3, n))


@pytest.mark.parametrize("method,group", [("int8", 0), ("int4", 32), ("int4", 128)])
def test_decoded_matrix_path(monkeypatch, method, group):
    """Prefill rows (>= LOWBIT_DEQUANT_ROWS): the kernel's int8 / int4 decode is ``dequantize`` bit for bit, and
    decoding in row chunks (smaller than the matrix here) gives what one whole decode gives."""
    require_kernels()
    ops = cpu_ops.get_ops()
    n, k = 203, 300  # 203 rows: chunks of 64 leave a ragged last one
    qw = QuantizedWeight.quantize(_weight(n, k, 7), method, group or 128)
    kp = qw.qweight.shape[1] * (2 if method == "int4" else 1)
    out = torch.full((n, kp), float("nan"))
    qw._decoder(ops)(out, 0, n)
    assert torch.equal(out[:, :k], qw.dequantize()) and not out[:, k:].any()  # int4's padded columns decode to 0
    with pytest.raises(RuntimeError, match="out must be contiguous fp32"):
        qw._decoder(ops)(torch.empty(n, kp + 1), 0, n)
    rows = LOWBIT_DEQUANT_ROWS[method]
    x = torch.randn(rows + 6, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4))
    whole = qw.matmul(x, bias)
    monkeypatch.setattr(quant_linear, "DEQUANT_CHUNK_BYTES", 64 * kp * 4)  # 64-row chunks
    chunked = qw.matmul(x, bias)
    exact = x @ qw.dequantize().t() + bias
    torch.testing.assert_close(whole, exact, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-4)
    few = qw.matmul(x[:rows - 1], bias)  # one row fewer: the register tile, same values
    torch.testing.assert_close(few, whole[:rows - 1], rtol=1e-5, atol=1e-4)


def _greedy(path, quant, kernels, monkeypatch, **kw):
    # fp32 whatever the host ("auto" is bf16 on native-bf16 CPUs): kernel and reference both compute in fp32 and
    # differ only in summation order, so fp32 tokens agree. A bf16 model rounds every linear's and norm's output to
    # 8 bits, which moved this model's int8 logprobs by up to 0.022 between kernels on and off (AVX-512 host), and
    # its bf16 logits tie exactly (top-2 margin 0 or one bf16 step) at some greedy steps: the tokens may part there.
    kw.setdefault("dtype", "float32")
    with monkeypatch.context() as mp:
        mp.setenv("OPENINFER_CPU_KERNELS", "1" if kernels else "0")
        llm = LLM(model=str(path), quantization=quant, num_kv_blocks=64, **kw)
        model = engine_model(llm)
        prompts = random_prompts(3, [5, 20, 9], vocab_size=100)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        toks = [o.outputs[0].token_ids for o in outs]
        nbytes = weight_bytes(model)
    return toks, model, nbytes


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_llama_greedy_same_with_kernels_on_and_off(tmp_path, monkeypatch, quant):
    require_kernels()
    path = make_dense_checkpoint(tmp_path / "m", vocab_size=128, hidden_size=128, intermediate_size=256)
    fast, model, _ = _greedy(path, quant, True, monkeypatch)
    quantised = [m for m in model.modules() if isinstance(m, Linear) and m._quant is not None]
    assert len(quantised) == 2 * 4 + 1  # qkv, o, gate_up, down in each of 2 layers, and the LM head
    ref, _, _ = _greedy(path, quant, False, monkeypatch)
    assert fast == ref


def test_resident_weight_bytes(tmp_path, monkeypatch):
    """bf16 weights vs int8 / int4 of the same checkpoint: the linears shrink to ~1/2 and ~1/4 (plus scales)."""
    path = make_dense_checkpoint(tmp_path / "m", vocab_size=128, hidden_size=128, intermediate_size=256)
    sizes = {}
    for quant in (None, "int8", "int4"):
        llm = LLM(model=str(path), quantization=quant, dtype="bfloat16", num_kv_blocks=16)
        model = engine_model(llm)
        linear = [m for m in model.modules() if isinstance(m, Linear)]
        sizes[quant] = sum(m._quant.nbytes if m._quant is not None else m.in_features * m.out_features * 2
                           for m in linear)
        assert weight_bytes(model) > sizes[quant]  # plus the embedding and norms
    assert 0.49 < sizes["int8"] / sizes[None] < 0.53
    assert 0.25 < sizes["int4"] / sizes[None] < 0.29


def test_deepseek_v3_experts_quantised_greedy_same_with_kernels_on_and_off(tmp_path, monkeypatch):
    require_kernels()
    from test_deepseek_v3 import make_hf_v3

    path = make_hf_v3(tmp_path / "v3")
    fast, model, _ = _greedy(path, "int8", True, monkeypatch)
    experts = [m for m in model.modules() if type(m).__name__ == "DeepseekExperts"]
    assert experts and all(isinstance(w, QuantizedWeight) for m in experts for ws in m._packed for w in ws)
    ref, _, _ = _greedy(path, "int8", False, monkeypatch)
    assert fast == ref


def test_quantization_errors(tmp_path):
    path = make_dense_checkpoint(tmp_path / "m")
    with pytest.raises(ValueError, match="quantization='int3'"):
        EngineArgs(model=str(path), quantization="int3").create_engine_config()
    v4 = tmp_path / "v4"
    v4.mkdir()
    cfg = json.loads((path / "config.json").read_text())
    (v4 / "config.json").write_text(json.dumps({**cfg, "architectures": ["DeepseekV4ForCausalLM"]}))
    with pytest.raises(ValueError, match="quantization='int8' is not supported by DeepseekV4ForCausalLM"):
        EngineArgs(model=str(v4), quantization="int8").create_engine_config()
    with pytest.raises(ValueError, match="quantization='int8' cannot be combined with enable_eplb"):
        EngineArgs(model=str(path), quantization="int8", enable_eplb=True).create_engine_config()
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    (fp8 / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match="quantization='int4'.*already quantised"):
        EngineArgs(model=str(fp8), quantization="int4").create_engine_config()
    assert EngineArgs(model=str(path), quantization="int8").create_engine_config().model.quantization == "int8"
