"""DeepSeek-V4 quantised checkpoints: FP8 block-128 linears (UE8M0 ``.scale`` and fp32 ``weight_scale_inv``)
and MXFP4 experts load like their dequantised twins (the same weights dequantised independently here and saved
unquantised); the FP4 nibble order and UE8M0 scales against hand-written examples; malformed checkpoints fail
naming the tensor."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import dense_state
from openinfer import LLM, SamplingParams
from openinfer.worker.loader import iterate_weights, read_checkpoint
from openinfer.layers.fp8 import (E8M0_DTYPE, FP8_DTYPE, Fp8Weight, dequantize_fp8_block, fp8_block_size,
                                  quantize_fp8_block)
from openinfer.layers.deepseek_moe import DeepseekExperts
from openinfer.layers.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from openinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from openinfer.models.weights import WeightLoadError

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ["release-fp4", "hf-fp8"]


def _generator():
    script = ROOT / "scripts" / "make_deepseek_v4_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_v4", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def plain_e2m1(nibble: torch.Tensor) -> torch.Tensor:
    """E2M1 from its bit fields (sign | 2-bit exponent, bias 1 | 1-bit mantissa), not from a table."""
    sign = 1 - 2 * (nibble >> 3).float()
    exp, man = (nibble >> 1) & 3, (nibble & 1).float()
    normal = torch.exp2(exp.float() - 1) * (1 + man / 2)
    return sign * torch.where(exp == 0, man / 2, normal)


def plain_dequant(weight: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Block loops over the scales; FP4 bytes split with % and // (low nibble first)."""
    s = scale.float()
    if weight.dtype == FP8_DTYPE:
        w, rows, cols = weight.float(), block[0], block[1]
    else:
        b = weight.view(torch.uint8).long()
        w = plain_e2m1(torch.stack([b % 16, b // 16], dim=-1).flatten(1))
        rows, cols = 1, 32
    out = torch.empty(w.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = (slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))
            out[blk] = w[blk] * float(s[i, j])
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    # hidden 256: the hidden-facing linears span two 128-column blocks; q_lora 64 rows make ragged row blocks.
    out = tmp_path_factory.mktemp("v4q") / "base"
    return _generator().make_checkpoint(out, "tiny", seed=0, hidden_size=256)


@pytest.fixture(scope="module", params=FORMATS)
def quant_pair(request, base, tmp_path_factory):
    """(quantised checkpoint, its fp32 twin, the unquantised original's tensors by quantised name)."""
    root = tmp_path_factory.mktemp(request.param)
    quant = _generator().quantize_checkpoint(base, root / "quant", request.param)
    tensors = read_checkpoint(quant)
    suffix = ".scale" if request.param == "release-fp4" else ".weight_scale_inv"
    plain = {}
    for name, t in tensors.items():
        if name.endswith(suffix):
            continue
        if t.dtype in (FP8_DTYPE, torch.int8):
            plain[name] = plain_dequant(t, tensors[name.removesuffix(".weight") + suffix])
        else:
            plain[name] = t.float()
    twin = root / "twin"
    twin.mkdir()
    save_file(plain, str(twin / "model.safetensors"))
    cfg = json.loads((quant / "config.json").read_text())
    del cfg["quantization_config"], cfg["expert_dtype"]
    (twin / "config.json").write_text(json.dumps(cfg))
    for f in quant.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, twin / f.name)
    return quant, twin, tensors


def test_quantised_checkpoint_has_the_release_layout(quant_pair):
    quant, _, tensors = quant_pair
    dtypes = {n: t.dtype for n, t in tensors.items()}
    release = any(n.endswith(".scale") for n in dtypes)
    assert json.loads((quant / "config.json").read_text())["expert_dtype"] == ("fp4" if release else "fp8")
    wq_a = "layers.2.attn.wq_a" if release else "model.layers.2.attn.wq_a"
    assert dtypes[f"{wq_a}.weight"] == FP8_DTYPE and tensors[f"{wq_a}.weight"].shape == (64, 256)
    scale = tensors[f"{wq_a}.scale" if release else f"{wq_a}.weight_scale_inv"]
    assert scale.shape == (1, 2) and scale.dtype == (E8M0_DTYPE if release else torch.float32)
    expert = f"{'' if release else 'model.'}layers.1.ffn.experts.5.w2"
    if release:  # MXFP4: [256, 64] packed two per byte, one UE8M0 scale per 32 values
        assert dtypes[f"{expert}.weight"] == torch.int8 and tensors[f"{expert}.weight"].shape == (256, 32)
        assert tensors[f"{expert}.scale"].shape == (256, 2)
    else:
        assert dtypes[f"{expert}.weight"] == FP8_DTYPE
    unquantised = [n for n in dtypes if "compressor" in n or "gate.weight" in n or "weights_proj" in n]
    assert unquantised and all(dtypes[n] == torch.float32 for n in unquantised)


def test_quantised_checkpoint_loads_like_its_dequantised_twin(quant_pair, base):
    quant, twin, _ = quant_pair
    models = []
    for path in (quant, twin):
        m = DeepseekV4ForCausalLM(json.loads((path / "config.json").read_text()))
        m.load_weights(iterate_weights(path))
        models.append(m)
    a, b = (dense_state(m) for m in models)  # packed weights (MXFP4 experts, FP8 linears) dequantised
    assert a.keys() == b.keys()
    fp4 = json.loads((quant / "config.json").read_text())["expert_dtype"] == "fp4"
    twin_modules = dict(models[1].named_modules())
    experts = [(n, e) for n, e in models[0].named_modules() if isinstance(e, DeepseekExperts)]
    assert experts and all(e.mxfp4 == fp4 and not twin_modules[n].mxfp4 for n, e in experts)
    # FP8 experts stay as shipped too (fp8_block), and so do the FP8 linears but o_a_proj (read as a matrix)
    assert all((e.fp8_block is None) == fp4 and twin_modules[n].fp8_block is None for n, e in experts)
    assert all(e.w13_weight.numel() == 0 for _, e in experts)
    fp8_linears = {n for n, mod in models[0].named_modules() if isinstance(getattr(mod, "_quant", None), Fp8Weight)}
    assert "model.layers.2.self_attn.q_a_proj" in fp8_linears and "model.layers.2.mlp.shared_experts.gate_up_proj" \
        in fp8_linears and not any(n.endswith("o_a_proj") for n in fp8_linears), sorted(fp8_linears)
    for name in a:  # the packed codes and scales dequantise to exactly the twin's weights
        assert torch.equal(a[name], b[name]), name
    # ...and the dequantised weights are near the unquantised originals (FP4 is coarse: 1 bit of mantissa).
    orig = DeepseekV4ForCausalLM(json.loads((base / "config.json").read_text()))
    orig.load_weights(iterate_weights(base))
    w13, w = a["model.layers.1.mlp.experts.w13_weight"], orig.model.layers[1].mlp.experts.w13_weight
    rel = float((w13 - w).norm() / w.norm())
    assert 0 < rel < (0.2 if fp4 else 0.05), rel
    q_a, q_a0 = a["model.layers.2.self_attn.q_a_proj.weight"], orig.model.layers[2].self_attn.q_a_proj.weight
    assert 0 < float((q_a - q_a0).detach().norm() / q_a0.detach().norm()) < 0.05

    prompts = [{"prompt_token_ids": list(range(6, 6 + n))} for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    runs = [LLM(str(p), dtype="float32", max_model_len=128, num_kv_blocks=16).generate(prompts, params,
                                                                                         use_tqdm=False)
            for p in (quant, twin)]
    for x, y in zip(*runs):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for j, tok in enumerate(x.outputs[0].token_ids):
            assert abs(x.outputs[0].logprobs[j][tok] - y.outputs[0].logprobs[j][tok]) < 1e-4


def test_mxfp4_nibble_order_and_scales_by_hand():
    # Low nibble = lower-index element. 0x21 -> [0.5, 1]; 0xF9 -> [-0.5, -6]; 0x70 -> [0, 6]; 0x08 -> [-0, 0].
    packed = torch.tensor([[0x21, 0xF9, 0x70, 0x08], [0x21, 0xF9, 0x70, 0x08]], dtype=torch.uint8)
    scale = torch.tensor([[128], [126]], dtype=torch.uint8).view(E8M0_DTYPE)  # 2^1, 2^-1
    want = torch.tensor([[1.0, 2.0, -1.0, -12.0, 0.0, 12.0, -0.0, 0.0],
                         [0.25, 0.5, -0.25, -3.0, 0.0, 3.0, -0.0, 0.0]])
    assert torch.equal(dequantize_mxfp4(packed.view(torch.int8), scale, torch.float32), want)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.float32), want)  # uint8 storage reads the same
    # One scale per 32 values along the row: 64 values of 1.0 (0x22) under scales 2^0 and 2^2.
    scales = torch.tensor([[127, 129]], dtype=torch.uint8).view(E8M0_DTYPE)
    two_blocks = dequantize_mxfp4(torch.full((1, 32), 0x22, dtype=torch.uint8), scales, torch.float32)
    assert torch.equal(two_blocks, torch.tensor([[1.0] * 32 + [4.0] * 32]))
    # Every nibble: the table equals the E2M1 bit-field definition.
    every = torch.arange(16, dtype=torch.uint8).view(1, 8, 2)
    packed_all = (every[..., 0] | every[..., 1] << 4).view(torch.int8)
    one = torch.full((1, 1), 127, dtype=torch.uint8).view(E8M0_DTYPE)
    want_all = plain_e2m1(torch.arange(16)).view(1, 16)
    assert torch.equal(dequantize_mxfp4(packed_all, one, torch.float32), want_all)


def test_mxfp4_quantiser_round_trips_representable_values():
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    sign = torch.where(torch.rand(6, 64, generator=g) < 0.5, -1.0, 1.0)
    w = grid[torch.randint(0, 8, (6, 64), generator=g)] * sign
    w[:, 0] = 6.0  # every block reaches 6 so the power-of-two scale is exactly 1 (x 2^k per row below)
    w[:, 32] = -6.0
    w = w * torch.exp2(torch.arange(-3, 3).float())[:, None]
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (6, 32) and scale.shape == (6, 2) and scale.dtype == E8M0_DTYPE
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.float32), w)
    with pytest.raises(ValueError, match=r"needs \(6, 2\)"):
        dequantize_mxfp4(packed, scale[:, :1])


def test_ue8m0_fp8_scales():
    torch.manual_seed(0)
    w = torch.randn(200, 300) * torch.linspace(0.01, 3, 300)
    q, s = quantize_fp8_block(w, scale_fmt="ue8m0")
    assert s.dtype == E8M0_DTYPE and s.shape == (2, 3)
    sf = s.float()
    assert torch.equal(sf, torch.exp2(torch.log2(sf).round()))  # powers of two
    deq = dequantize_fp8_block(q, s, dtype=torch.float32)
    assert torch.equal(deq, plain_dequant(q, s))
    # Rounding the scale up to a power of two at most doubles the e4m3 step: each block within amax / 8.
    for i in range(2):
        for j in range(3):
            blk = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            assert (deq - w)[blk].abs().max() <= w[blk].abs().max() / 8
    qc = {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    assert fp8_block_size({"quantization_config": qc}) == (128, 128)
    with pytest.raises(ValueError, match="scale_fmt"):
        fp8_block_size({"quantization_config": {**qc, "scale_fmt": "e5m2"}})
    with pytest.raises(ValueError, match="scale dtype"):
        dequantize_fp8_block(q, s.view(torch.uint8))  # raw exponent bytes are ambiguous: refused


def _load(path: Path, drop: str | None = None, cfg_edit=None, tensor_edit=None) -> None:
    cfg = json.loads((path / "config.json").read_text())
    if cfg_edit:
        cfg_edit(cfg)
    tensors = [(n, tensor_edit(n, t) if tensor_edit else t) for n, t in read_checkpoint(path).items() if n != drop]
    DeepseekV4ForCausalLM(cfg).load_weights(tensors)


def test_malformed_quantised_checkpoints_name_the_tensor(quant_pair):
    quant, _, tensors = quant_pair
    release = any(n.endswith(".scale") for n in tensors)
    prefix, suffix = ("", ".scale") if release else ("model.", ".weight_scale_inv")
    wq_b = f"{prefix}layers.3.attn.wq_b"
    with pytest.raises(WeightLoadError, match=rf"without a scale.*{wq_b}\.weight"):
        _load(quant, drop=wq_b + suffix)
    with pytest.raises(WeightLoadError, match=rf"scales without a weight.*{wq_b}{suffix}"):
        _load(quant, drop=wq_b + ".weight")
    with pytest.raises(WeightLoadError, match=rf"{wq_b}\.weight.*needs \(2, 1\)"):
        _load(quant, tensor_edit=lambda n, t: t[:1] if n == wq_b + suffix else t)
    with pytest.raises(WeightLoadError, match=r"float8 but config.json has no fp8 quantization_config"):
        _load(quant, cfg_edit=lambda c: c.pop("quantization_config"))
    if release:  # packed FP4 experts in a checkpoint whose config does not say fp4
        with pytest.raises(WeightLoadError, match=r"experts\.\d+\.w\d\.weight' is torch.int8.*'fp8'"):
            _load(quant, cfg_edit=lambda c: c.update(expert_dtype="fp8"))


def test_out_of_range_hash_table_is_rejected(base):
    with pytest.raises(WeightLoadError, match=r"tid2eid.*outside \[0, n_routed_experts=8\)"):
        _load(base, tensor_edit=lambda n, t: t + 8 if n.endswith("tid2eid") else t)
