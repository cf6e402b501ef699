"""FP8 e4m3 block-128 weights: the dequantiser against a block loop, and an FP8 DeepSeek-V3 checkpoint against
its fp32 twin (the same weights dequantised independently and saved unquantised)."""
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
from openinfer.layers.fp8 import FP8_DTYPE, Fp8Weight, dequantize_fp8_block, fp8_block_size, quantize_fp8_block
from openinfer.layers.deepseek_moe import DeepseekExperts
from openinfer.layers.linear import Linear
from openinfer.models.deepseek_v3 import DeepseekV3ForCausalLM
from openinfer.models.weights import WeightLoadError

ROOT = Path(__file__).resolve().parents[1]


def loop_dequant(weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    out = torch.empty(weight.shape, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows = slice(i * block[0], (i + 1) * block[0])
            cols = slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = weight[rows, cols].float() * float(scale_inv[i, j])
    return out


def test_dequantize_matches_block_loop_on_ragged_shapes():
    torch.manual_seed(0)
    w = torch.randn(200, 300) * torch.linspace(0.01, 3, 300)  # per-block ranges differ
    q, s = quantize_fp8_block(w)
    assert q.dtype == FP8_DTYPE and s.shape == (2, 3) and s.dtype == torch.float32
    deq = dequantize_fp8_block(q, s, dtype=torch.float32)
    assert torch.equal(deq, loop_dequant(q, s))
    # e4m3 keeps 3 mantissa bits: every block is within 1/16 of its own amax.
    err = (deq - w).abs()
    for i in range(2):
        for j in range(3):
            blk = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            assert err[blk].max() <= w[blk].abs().max() / 16
    assert dequantize_fp8_block(q, s).dtype == torch.bfloat16


def test_dequantize_rejects_wrong_scale_shape():
    q, s = quantize_fp8_block(torch.randn(200, 300))
    with pytest.raises(ValueError, match=r"needs \(2, 3\)"):
        dequantize_fp8_block(q, s[:, :2])


def test_quantization_config_parsing():
    assert fp8_block_size({}) is None
    assert fp8_block_size({"quantization_config": {"quant_method": "fp8"}}) == (128, 128)
    qc = {"quant_method": "fp8", "weight_block_size": [64, 32]}
    assert fp8_block_size({"quantization_config": qc}) == (64, 32)
    with pytest.raises(ValueError, match="quant_method"):
        fp8_block_size({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8_block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}})


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """(FP8 checkpoint, its fp32 twin). Tiny shards put many weights and their scales in different files."""
    script = ROOT / "scripts" / "make_deepseek_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_ckpt", script)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fp8 = gen.make_v3(tmp_path_factory.mktemp("fp8"), "small", fp8=True, seed=0, shard_gb=2e-5)
    twin = tmp_path_factory.mktemp("twin")
    tensors = read_checkpoint(fp8)
    plain = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        plain[name] = loop_dequant(t, tensors[name + "_scale_inv"]) if t.dtype == FP8_DTYPE else t.float()
    assert sum(t.dtype == FP8_DTYPE for t in tensors.values()) > 20
    save_file(plain, str(twin / "model.safetensors"))
    cfg = json.loads((fp8 / "config.json").read_text())
    del cfg["quantization_config"]
    (twin / "config.json").write_text(json.dumps(cfg))
    for f in fp8.iterdir():
        if "token" in f.name or f.suffix == ".jinja":
            shutil.copy(f, twin / f.name)
    return fp8, twin


@pytest.mark.parametrize("mode", ["packed", "dequantize"])
def test_fp8_checkpoint_loads_like_its_fp32_twin(fp8_pair, mode, monkeypatch):
    """Packed (the default) or dequantised at load (OPENINFER_FP8_WEIGHTS=dequantize), the weights are the twin's
    exactly; packed, the routed experts and every linear but kv_b_proj (read as a matrix by MLA) and the
    (unquantised) LM head hold the checkpoint's codes and multipliers (Fp8Weights), a third of fp32's bytes or less."""
    monkeypatch.setenv("OPENINFER_FP8_WEIGHTS", mode)
    fp8, twin = fp8_pair
    models = []
    for path in (fp8, twin):
        m = DeepseekV3ForCausalLM(json.loads((path / "config.json").read_text()))
        m.load_weights(iterate_weights(path))
        models.append(m)
    a, b = (dense_state(m) for m in models)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    linears = {n: mod for n, mod in models[0].named_modules() if isinstance(mod, Linear)}
    packed = {n for n, mod in linears.items() if isinstance(mod._quant, Fp8Weight)}
    experts = [mod for mod in models[0].modules() if isinstance(mod, DeepseekExperts)]
    assert experts
    for mod in experts:
        ws = mod._packed[0] + mod._packed[1] if mod._packed is not None else []
        if mode == "dequantize":
            assert mod.fp8_block is None and not any(isinstance(w, Fp8Weight) for w in ws)
        else:
            assert mod.w13_weight.numel() == 0 and len(ws) == 2 * mod.num_experts
            assert all(isinstance(w, Fp8Weight) and w.nbytes < 0.3 * w.numel() * 4 for w in ws)
    if mode == "dequantize":
        assert not packed
    else:
        want = {n for n in linears if not n.endswith("kv_b_proj") and n != "lm_head"}
        assert packed == want, sorted(want ^ packed)
        for n in packed:
            mod = linears[n]
            assert mod.weight.numel() == 0
            assert mod._quant.nbytes < 0.3 * mod.out_features * mod.in_features * 4, n

    prompts = [{"prompt": "the quick brown fox jumps"}, {"prompt": "FP8 block scales: 128 x 128!"}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    runs = [LLM(str(p), dtype="float32", num_kv_blocks=16).generate(prompts, params, use_tqdm=False)
            for p in (fp8, twin)]
    for x, y in zip(*runs):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for j, tok in enumerate(x.outputs[0].token_ids):
            assert abs(x.outputs[0].logprobs[j][tok] - y.outputs[0].logprobs[j][tok]) < 1e-4


def test_fp8_weight_without_scale_is_rejected(fp8_pair):
    fp8 = fp8_pair[0]
    cfg = json.loads((fp8 / "config.json").read_text())
    drop = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    tensors = [(n, t) for n, t in iterate_weights(fp8) if n != drop]
    with pytest.raises(WeightLoadError, match=r"experts\.3\.down_proj\.weight"):
        DeepseekV3ForCausalLM(cfg).load_weights(tensors)
    del cfg["quantization_config"]  # float8 tensors in a checkpoint that does not declare FP8
    with pytest.raises(WeightLoadError, match="float8"):
        DeepseekV3ForCausalLM(cfg).load_weights(iterate_weights(fp8))
