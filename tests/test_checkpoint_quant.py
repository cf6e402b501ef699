"""Low-bit checkpoints as published (compressed-tensors W8A8 / W4A16, GPTQ int4 sym and asym, AWQ int4) and W8A8
int8 execution: the W8A8 kernel (cpu_kernels/w8a8_gemm.cpp) against its torch reference, the int4 zero-point
correction against an exact (q - z) * s product, AWQ's nibble order, each format written by
scripts/make_quantized_checkpoint.py and loaded packed through the real loader (the integers and scales exactly as
in the file, resident bytes ~ the file's), greedy tokens with kernels on and off, the asymmetric formats against the
same weights dequantised into a plain checkpoint, and the config errors."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import engine_model, load_script, make_dense_checkpoint, random_prompts, require_kernels
from safetensors.torch import load_file

from openinfer import LLM, SamplingParams
from openinfer.engine_args import EngineArgs
from openinfer.layers import cpu_ops
from openinfer.layers.linear import Linear, weight_bytes
from openinfer.layers.quant_linear import QuantizedWeight, w8a8_reference

mq = load_script("make_quantized_checkpoint")
FORMATS = {"w8a8": "w8a8", "w4a16": "int4", "gptq": "int4", "gptq-asym": "int4", "awq": "int4"}  # -> what runs it
AUTOAWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ WQLinear_GEMM.from_linear's order_map, restated independently


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("m", [1, 4, 5, 33])  # 1 and 4: the one-row-at-a-time pass; 5, 33: the 4-row block
def test_w8a8_kernel_matches_reference(monkeypatch, m):
    require_kernels()
    for i, (n, k) in enumerate([(7, 37), (9, 100), (40, 300), (130, 1000), (5, 64)]):  # K % 32 != 0 mostly
        w = torch.randint(-128, 128, (n, k), generator=_gen(i), dtype=torch.int8)
        w[0] = -128  # the extremes: |w| = 128 must not overflow the sign trick
        w[1] = 127
        w[2] = 0
        x = torch.randn(m, k, generator=_gen(50 + i)) * 4
        x[0] = -x[0].abs()  # a row whose every quantised value is negative, down to -127, against w = -128
        if m > 1:
            x[1] = 0.0  # an all-zero token: scale 1, output exactly 0 (+ bias)
        scales = torch.rand(n, generator=_gen(90 + i)) * 0.01 + 1e-4
        qw = QuantizedWeight("w8a8", w, scales, (n, k), torch.float32)
        fast = qw.matmul(x)
        with monkeypatch.context() as mp:
            mp.setenv("OPENINFER_CPU_KERNELS", "0")
            ref = qw.matmul(x)
        assert torch.equal(fast, ref), (m, n, k)  # same integers, same fp32 operations in the same order
        xs = x.abs().amax(1).clamp_min(1e-30) / 127
        xq = torch.round(x / xs[:, None]).clamp(-127, 127)
        exact = (xq.double() @ w.double().t()) * xs[:, None].double() * scales.double()
        assert torch.allclose(fast.double(), exact, rtol=1e-5, atol=1e-6)
        assert int(xq[0].min()) == -127 and (fast[0, 2] == 0)
        bias = torch.randn(n, generator=_gen(7))
        torch.testing.assert_close(qw.matmul(x, bias), w8a8_reference(x, w, scales, bias), rtol=1e-6, atol=1e-6)
    bf = x.to(torch.bfloat16)  # bf16 activations come back bf16
    assert qw.matmul(bf).dtype == torch.bfloat16


def test_awq_nibble_order_round_trip():
    """The writer packs AWQ's order, the loader reads it back, and both agree with AutoAWQ's packing loop."""
    from openinfer.layers.checkpoint_quant import unpack_awq_columns
    # Columns 0..7 holding 0..7: nibble i holds column AUTOAWQ_ORDER[i], so the word reads 7 5 3 1 6 4 2 0.
    assert int(mq.pack_awq(torch.arange(8)[None])) & 0xFFFFFFFF == 0x75316420
    v = torch.randint(0, 16, (6, 40), generator=_gen(3))
    v[0, :8] = 15  # the sign bit of the int32 word
    words = mq.pack_awq(v)
    assert words.dtype == torch.int32 and words.shape == (6, 5)
    assert torch.equal(_awq_unpack(words), v)
    assert torch.equal(unpack_awq_columns(words).long(), v)


@pytest.mark.parametrize("m", [1, 5, 33, 70])  # 70: from LOWBIT_DEQUANT_ROWS the decoded matrix + GEMM
def test_int4_zero_correction_matches_exact(monkeypatch, m):
    """Asymmetric int4 (zero_corr = (s (8 - z))^T): the kernel + group-sum correction and the dequantising torch
    reference both match sum_k x_k (q_k - z) s computed exactly, including K not a multiple of 16 or the group."""
    from openinfer.layers.checkpoint_quant import pack_kernel_int4
    for i, (n, k, g) in enumerate([(40, 100, 32), (9, 256, 128), (24, 64, 16)]):
        q = torch.randint(0, 16, (n, k), generator=_gen(i), dtype=torch.uint8)
        groups = -(-k // g)
        s = (torch.rand(n, groups, generator=_gen(10 + i)) * 0.02 + 1e-3).half().float()  # as checkpoints store it
        z = torch.randint(0, 17, (n, groups), generator=_gen(20 + i))  # GPTQ v1 may read a zero of 16
        qw = QuantizedWeight("int4", pack_kernel_int4(q), s, (n, k), torch.float32, g,
                              (s * (8 - z.float())).t().contiguous())
        w = (q.double() - z.double().repeat_interleave(g, 1)[:, :k]) * s.double().repeat_interleave(g, 1)[:, :k]
        assert torch.equal(qw.dequantize().double(), w)  # (q - 8) s + s (8 - z) is exact in fp32
        x = torch.randn(m, k, generator=_gen(30 + i))
        bias = torch.randn(n, generator=_gen(40 + i))
        exact = x.double() @ w.t() + bias.double()
        with monkeypatch.context() as mp:
            mp.setenv("OPENINFER_CPU_KERNELS", "0")
            ref = qw.matmul(x, bias)
        torch.testing.assert_close(ref.double(), exact, rtol=1e-5, atol=1e-5)
        if cpu_ops.available():
            torch.testing.assert_close(qw.matmul(x, bias).double(), exact, rtol=1e-5, atol=1e-5)
        # Fusing an asymmetric part with a symmetric one (zero correction 0) keeps both exact.
        sym = QuantizedWeight("int4", pack_kernel_int4(q[:3]), s[:3], (3, k), torch.float32, g)
        fused = QuantizedWeight.cat([qw, sym])
        assert fused.zero_corr.shape == (groups, n + 3) and not fused.zero_corr[:, n:].any()
        torch.testing.assert_close(fused.matmul(x), torch.cat([qw.matmul(x), sym.matmul(x)], 1), rtol=1e-5,
                                   atol=1e-5)


def _file_dequant(path, fmt, prefix, group):
    """What the checkpoint file says the weight is, decoded here independently of the loader."""
    t = load_file(str(path / "model.safetensors"))
    if fmt == "w8a8":
        return t[f"{prefix}.weight"].float() * t[f"{prefix}.weight_scale"].float()
    if fmt == "w4a16":
        n, k = t[f"{prefix}.weight_shape"].tolist()
        p = t[f"{prefix}.weight_packed"].to(torch.int64) & 0xFFFFFFFF
        q = torch.stack([(p >> (4 * i)) & 0xF for i in range(8)], dim=2).reshape(n, -1)[:, :k] - 8
        return q.float() * t[f"{prefix}.weight_scale"].float().repeat_interleave(group, 1)[:, :k]
    if fmt == "awq":
        return _awq_decode(t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"], t[f"{prefix}.scales"], group)
    p = t[f"{prefix}.qweight"].to(torch.int64) & 0xFFFFFFFF  # [K / 8, N]
    q = torch.stack([(p >> (4 * i)) & 0xF for i in range(8)], dim=1).reshape(-1, p.shape[1]).t()
    zp = t[f"{prefix}.qzeros"].to(torch.int64) & 0xFFFFFFFF  # [G, N / 8], zero - 1
    z = torch.stack([(zp >> (4 * i)) & 0xF for i in range(8)], dim=2).reshape(zp.shape[0], -1).t() + 1
    return (q - z.repeat_interleave(group, 1)).float() * t[f"{prefix}.scales"].float().t().repeat_interleave(group, 1)


def _awq_unpack(words):
    """AutoAWQ's int32 [R, C / 8] -> int64 [R, C], one column at a time as WQLinear_GEMM.from_linear packed it."""
    p = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(p.shape[0], p.shape[1] * 8, dtype=torch.int64)
    for j in range(p.shape[1]):
        for i in range(8):
            out[:, 8 * j + AUTOAWQ_ORDER[i]] = (p[:, j] >> (4 * i)) & 0xF
    return out


def _awq_decode(qweight, qzeros, scales, group):
    """W [N, K] = ((q - z) * s)^T, AWQ's [K, N] layout read as AutoAWQ's dequantize_gemm does."""
    q, z = _awq_unpack(qweight), _awq_unpack(qzeros).repeat_interleave(group, 0)
    return ((q - z).float() * scales.float().repeat_interleave(group, 0)).t()


def _run(path, kernels, monkeypatch, **kw):
    """Greedy tokens and their logprobs, in fp32 whatever the host. dtype "auto" would be bf16 on a CPU with native
    bf16 (AVX512-BF16 / AMX) and fp32 on an AVX2 host, and these tests' claims are fp32 ones: the resident bytes
    equal the fp32 file's (bf16 would halve the dense embedding / LM head / norms: 66,816 of 436,736 bytes here);
    the dequantised plain checkpoint holds exactly the packed model's weights ((q - z) s rounded to bf16 would not:
    an fp16 scale has 11 significant bits); and kernels on / off differ only in fp32 summation order (~1e-6
    relative), far inside the logprob bound and the top-2 logit margins. In bf16 every linear's and norm's output
    is rounded to 8 bits, which moves this tiny model's logprobs by up to ~0.2 against fp32 on either path, and
    its bf16 logits tie exactly (margin 0 or one bf16 step, 2^-6 here) at some greedy steps."""
    kw.setdefault("dtype", "float32")
    with monkeypatch.context() as mp:
        mp.setenv("OPENINFER_CPU_KERNELS", "1" if kernels else "0")
        llm = LLM(model=str(path), num_kv_blocks=64, **kw)
        prompts = random_prompts(3, [5, 20, 9], vocab_size=100)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1))
        toks = [o.outputs[0].token_ids for o in outs]
        lps = [[float(d[t]) for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
        model = engine_model(llm)
        llm.engine.shutdown()
    return toks, lps, model


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_published_format_loads_packed(tmp_path, monkeypatch, fmt):
    src = make_dense_checkpoint(tmp_path / "src", vocab_size=128, hidden_size=128, intermediate_size=256)
    dst = mq.convert(src, tmp_path / fmt, fmt, group=32)
    toks, lps, model = _run(dst, False, monkeypatch)
    layer = model.model.layers[1]
    for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(mod._quant, QuantizedWeight) and mod._quant.method == FORMATS[fmt]
        assert mod.weight.numel() == 0  # no dense copy kept
    assert model.lm_head._quant is None  # ignore: ["lm_head"]
    # The loaded integers and scales are exactly the file's: fused q|k|v rows in order.
    want = torch.cat([_file_dequant(dst, fmt, f"model.layers.1.self_attn.{p}_proj", 32) for p in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj._quant.dequantize(), want)
    want = _file_dequant(dst, fmt, "model.layers.1.mlp.down_proj", 32)
    assert torch.equal(layer.mlp.down_proj._quant.dequantize(), want)
    # Resident weight bytes ~ the checkpoint's (int4: + fp32 scales instead of the file's; minus GPTQ's g_idx).
    # The asymmetric formats also keep an fp32 zero correction per group instead of the file's half-byte zero: + 5.5
    # bytes per group of 32 here (awq 1.17x the file, gptq-asym 1.14x; at group 128 1.04x and 1.02x).
    file_bytes = sum(t.numel() * t.element_size() for t in load_file(str(dst / "model.safetensors")).values())
    quant = [m._quant for m in model.modules() if isinstance(m, Linear) and m._quant is not None]
    corr = sum(q.zero_corr.numel() * 4 for q in quant if q.zero_corr is not None)
    assert (corr > 0) == (fmt in ("gptq-asym", "awq"))
    assert 0.9 < (weight_bytes(model) - corr) / file_bytes < 1.1, (weight_bytes(model), corr, file_bytes)
    assert weight_bytes(model) / file_bytes < 1.2
    if cpu_ops.available():  # the same packed weights through the kernels: same greedy tokens, close logprobs
        fast, fast_lps, _ = _run(dst, True, monkeypatch)
        assert fast == toks
        for a, b in zip(fast_lps, lps):
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3


@pytest.mark.parametrize("fmt,arch", [("awq", "llama"), ("gptq-asym", "llama"), ("awq", "qwen2")])
def test_asymmetric_formats_match_dequantised_checkpoint(tmp_path, monkeypatch, fmt, arch):
    """The packed model (kernels, zero correction) gives the tokens and logprobs of the same weights dequantised
    (decoded from the file here, independently of the loader) and loaded as a plain fp32 checkpoint. Qwen2: q/k/v
    biases stay dense beside the quantised weights, as AutoAWQ writes them."""
    from safetensors.torch import save_file
    src = make_dense_checkpoint(tmp_path / "src", arch=arch, vocab_size=128, hidden_size=128,
                                intermediate_size=256)
    dst = mq.convert(src, tmp_path / fmt, fmt, group=32)
    dense = load_file(str(src / "model.safetensors"))
    for name in dense:
        if mq._is_target(name):
            dense[name] = _file_dequant(dst, fmt, name[:-len(".weight")], 32).contiguous()
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (plain / f.name).write_bytes(f.read_bytes())
    save_file(dense, str(plain / "model.safetensors"), metadata={"format": "pt"})
    toks, lps, model = _run(dst, cpu_ops.available(), monkeypatch)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv._quant.zero_corr is not None and (qkv.bias is not None) == (arch == "qwen2")
    want, want_lps, _ = _run(plain, cpu_ops.available(), monkeypatch)
    assert toks == want
    assert max(abs(x - y) for a, b in zip(lps, want_lps) for x, y in zip(a, b)) < 1e-3


def test_w8a8_quantized_at_load_kernels_match_reference(tmp_path, monkeypatch):
    """``--quantization w8a8`` on a dense checkpoint: the same W8A8 path, quantised at load."""
    require_kernels()
    src = make_dense_checkpoint(tmp_path / "src", vocab_size=128, hidden_size=128, intermediate_size=256)
    fast, fast_lps, model = _run(src, True, monkeypatch, quantization="w8a8")
    assert all(m._quant.method == "w8a8" for m in model.modules() if isinstance(m, Linear) and m._quant is not None)
    ref, ref_lps, _ = _run(src, False, monkeypatch, quantization="w8a8")
    assert fast == ref
    assert max(abs(x - y) for a, b in zip(fast_lps, ref_lps) for x, y in zip(a, b)) < 1e-3


def _write_config(tmp_path, name, qc):
    src = make_dense_checkpoint(tmp_path / "src", vocab_size=64)
    d = tmp_path / name
    d.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return d


@pytest.mark.parametrize("mutate,match", [
    (lambda qc: qc.update(format="float-quantized"), r"quantization_config.format='float-quantized'"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=3), r"weights.num_bits=3"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(symmetric=False), r"weights.symmetric=False"),
    (lambda qc: qc["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
     r"input_activations.dynamic=False"),
])
def test_compressed_tensors_config_errors(tmp_path, mutate, match):
    qc = mq.quantization_config("w8a8", 128)
    mutate(qc)
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(_write_config(tmp_path, "ct", qc))).create_engine_config()


@pytest.mark.parametrize("field,value", [("bits", 3), ("desc_act", True), ("sym", "no"), ("group_size", -1),
                                         ("checkpoint_format", "gptq_v2")])
def test_gptq_config_errors(tmp_path, field, value):
    qc = {**mq.quantization_config("gptq", 128), field: value}
    with pytest.raises(ValueError, match=rf"quantization_config.{field}={value!r}"):
        EngineArgs(model=str(_write_config(tmp_path, "gptq", qc))).create_engine_config()


@pytest.mark.parametrize("field,value", [("bits", 8), ("version", "gemv"), ("version", "marlin"),
                                         ("version", "exllama"), ("zero_point", False), ("group_size", -1),
                                         ("modules_to_not_convert", "lm_head")])
def test_awq_config_errors(tmp_path, field, value):
    qc = {**mq.quantization_config("awq", 128), field: value}
    with pytest.raises(ValueError, match=rf"quantization_config.{field}={value!r}"):
        EngineArgs(model=str(_write_config(tmp_path, "awq", qc))).create_engine_config()


def test_awq_bad_tensors(tmp_path):
    """A group size that does not divide a linear's K (the config is read before the tensors), and qzeros of the
    wrong shape: load errors naming the linear and what is wrong."""
    src = make_dense_checkpoint(tmp_path / "src", vocab_size=64)  # hidden 64, intermediate 128
    dst = mq.convert(src, tmp_path / "awq", "awq", group=32)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 48
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model.layers.0.*group_size=48 does not divide the input size K=(64|128)"):
        LLM(model=str(dst), num_kv_blocks=16)
    cfg["quantization_config"]["group_size"] = 32
    (dst / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file
    t = load_file(str(dst / "model.safetensors"))
    t["model.layers.1.self_attn.o_proj.qzeros"] = t["model.layers.1.self_attn.o_proj.qzeros"][:1].contiguous()
    save_file(t, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.o_proj.*qzeros must be int32 \(2, 8\)"):
        LLM(model=str(dst), num_kv_blocks=16)


def test_flag_must_match_checkpoint_and_bad_tensors(tmp_path):
    src = make_dense_checkpoint(tmp_path / "src", vocab_size=64)
    dst = mq.convert(src, tmp_path / "gptq", "gptq", group=32)
    with pytest.raises(ValueError, match="quantization='w8a8' does not match the checkpoint, which is int4"):
        EngineArgs(model=str(dst), quantization="w8a8").create_engine_config()
    assert EngineArgs(model=str(dst), quantization="int4").create_engine_config().model.quantization is None
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        EngineArgs(model=str(dst), tensor_parallel_size=2).create_engine_config()
    # Asymmetric zeros in the tensors (the config claims sym): a load error naming the linear.
    from safetensors.torch import save_file
    t = load_file(str(dst / "model.safetensors"))
    t["model.layers.0.mlp.up_proj.qzeros"] = torch.zeros_like(t["model.layers.0.mlp.up_proj.qzeros"])
    save_file(t, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.*sym is true"):
        LLM(model=str(dst), num_kv_blocks=16)
