"""DeepSeek-V4 (and V4.1) with MXFP4 routed experts kept packed (layers/mxfp4.py, cpu_kernels/mxfp4_gemm.cpp): the
engine's greedy tokens and logprobs against the same checkpoint with the experts dequantised at load
(``OPENINFER_MXFP4_EXPERTS=dequantize``), with the C++ kernel and with its torch reference
(``OPENINFER_CPU_KERNELS=0``); the experts' resident bytes; a mis-sized expert tensor named at load."""
from __future__ import annotations

import pytest
from helpers import engine_model, load_script

from openinfer import LLM, SamplingParams
from openinfer.layers import cpu_ops
from openinfer.layers.deepseek_moe import DeepseekExperts
from openinfer.layers.mxfp4 import Mxfp4Weight
from openinfer.models.weights import WeightLoadError


@pytest.fixture(scope="module")
def fp4_checkpoint(tmp_path_factory):
    gen = load_script("make_deepseek_v4_checkpoint")
    root = tmp_path_factory.mktemp("v4-mxfp4")
    base = gen.make_checkpoint(root / "base", "tiny", seed=1)
    return gen.quantize_checkpoint(base, root / "fp4", "release-fp4")


def _run(path, monkeypatch, experts: str, kernels: bool):
    with monkeypatch.context() as mp:
        mp.setenv("OPENINFER_MXFP4_EXPERTS", experts)
        mp.setenv("OPENINFER_CPU_KERNELS", "1" if kernels else "0")
        llm = LLM(str(path), dtype="float32", max_model_len=128, num_kv_blocks=16)
        prompts = [{"prompt_token_ids": list(range(6 + i, 6 + i + n))} for i, n in enumerate((5, 40, 17))]
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
        model = engine_model(llm)
        experts_mods = [m for m in model.modules() if isinstance(m, DeepseekExperts)]
        expert_bytes = sum(w.nbytes if isinstance(w, Mxfp4Weight) else w.numel() * w.element_size()
                           for m in experts_mods for ws in (m._packed or m._panels or (m.w13_weight, m.w2_weight)) for w in ws)
        packed = [m.mxfp4 for m in experts_mods]
    toks = [o.outputs[0].token_ids for o in outs]
    lps = [[o.outputs[0].logprobs[j][t] for j, t in enumerate(o.outputs[0].token_ids)] for o in outs]
    return toks, lps, expert_bytes, packed


def test_packed_experts_match_dequantised_at_load(fp4_checkpoint, monkeypatch):
    assert cpu_ops.available(), "the CPU kernels must build on this host (else the kernel path is not tested)"
    toks, lps, nbytes, packed = _run(fp4_checkpoint, monkeypatch, "packed", True)
    ref_toks, ref_lps, ref_bytes, ref_packed = _run(fp4_checkpoint, monkeypatch, "dequantize", True)
    torch_toks, torch_lps, _, _ = _run(fp4_checkpoint, monkeypatch, "packed", False)
    assert all(packed) and len(packed) == 4 and not any(ref_packed)
    assert toks == ref_toks == torch_toks
    for a, b, c in zip(lps, ref_lps, torch_lps):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
        assert max(abs(x - y) for x, y in zip(c, b)) < 1e-4
    # tiny: 8 experts x (w13 [128, 128] + w2 [128, 64]) per layer; fp32 dense 4 B per weight, packed 0.5 + 1/32
    assert ref_bytes == 4 * 8 * (128 * 128 + 128 * 64) * 4
    assert nbytes == 4 * 8 * (128 * 128 + 128 * 64) * (0.5 + 1 / 32)


def test_v41_packed_experts_match_dequantised_at_load(tmp_path, monkeypatch):
    """V4.1's checkpoints ship MXFP4 experts too (DSpark draft blocks included): kept packed by the same rule."""
    path = load_script("make_deepseek_v41_checkpoint").make_checkpoint(tmp_path / "v41", "tiny", seed=2)
    toks, lps, nbytes, packed = _run(path, monkeypatch, "packed", True)
    ref_toks, ref_lps, ref_bytes, ref_packed = _run(path, monkeypatch, "dequantize", True)
    assert packed and all(packed) and not any(ref_packed)
    assert toks == ref_toks
    for a, b in zip(lps, ref_lps):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert nbytes == ref_bytes / 4 * (0.5 + 1 / 32)  # fp32 dense 4 B per weight, packed 0.5 + a scale per 32


def test_misshapen_packed_expert_is_named(fp4_checkpoint):
    import json

    from openinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
    from openinfer.worker.loader import read_checkpoint

    cfg = json.loads((fp4_checkpoint / "config.json").read_text())
    tensors = read_checkpoint(fp4_checkpoint)
    name = "layers.2.ffn.experts.3.w2"
    tensors[f"{name}.weight"] = tensors[f"{name}.weight"][:, :16]  # K 64 -> 32
    tensors[f"{name}.scale"] = tensors[f"{name}.scale"][:, :1]
    with pytest.raises(WeightLoadError, match=r"expert 3 part 2: checkpoint slice has shape \(128, 32\)"):
        DeepseekV4ForCausalLM(cfg).load_weights(tensors.items())
    tensors = read_checkpoint(fp4_checkpoint)
    tensors[f"{name}.scale"] = tensors[f"{name}.scale"][:, :1]
    with pytest.raises(WeightLoadError, match=rf"{name}\.weight.*needs \(128, 2\)"):
        DeepseekV4ForCausalLM(cfg).load_weights(tensors.items())
