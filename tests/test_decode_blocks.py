"""The decode blocks (layers/decode_blocks.py, cpu_kernels/decode_blocks.cpp): DeepSeek's MLA attention and MoE of a
layer, and a whole Llama-family decoder layer, as one op each. They must give the bits of the modules' Python path
(``OPENINFER_DECODE_BLOCKS=0``) — the same greedy tokens and exactly the same log-probs — and they must actually run
where they apply (counted), and step aside where they do not (an fp8 cache, hash-routed layers, steps with a prefill,
biases, q / k norms)."""
from __future__ import annotations

import pytest
import torch
from helpers import engine_model, load_script, make_dense_checkpoint
from test_deepseek_v3 import make_hf_v3, make_prompts

from openinfer import LLM, SamplingParams
from openinfer.layers import cpu_ops, decode_blocks, quant_linear

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)


def _counted(monkeypatch) -> dict[str, int]:
    """How many times each block ran (returned a result) rather than stepping aside."""
    calls = {"mla": 0, "moe": 0, "llama": 0}
    real = {"mla": decode_blocks.mla_decode_block, "moe": decode_blocks.moe_block,
            "llama": decode_blocks.llama_decode_layer}

    def wrap(name):
        def run(*args, **kwargs):
            out = real[name](*args, **kwargs)
            calls[name] += out is not None
            return out
        return run

    monkeypatch.setattr(decode_blocks, "mla_decode_block", wrap("mla"))
    monkeypatch.setattr(decode_blocks, "moe_block", wrap("moe"))
    monkeypatch.setattr(decode_blocks, "llama_decode_layer", wrap("llama"))
    return calls


def _both_ways(monkeypatch, path, prompts, params=PARAMS, **llm_kw):
    """(outputs, block calls) with the blocks on, then off; prefix caching off so both runs compute every token the
    same way (a cached prefix would change the prefill path, not the blocks). ``params``: one SamplingParams, or
    one per prompt."""
    calls = _counted(monkeypatch)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("OPENINFER_DECODE_BLOCKS", flag)
        for k in calls:
            calls[k] = 0
        llm = LLM(str(path), enable_prefix_caching=False, num_kv_blocks=96, **llm_kw)
        trace = _trace_layers(engine_model(llm))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[flag] = ([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], dict(calls), trace)
    return runs


def _trace_layers(model) -> list[tuple[str, list[torch.Tensor]]]:
    """Every decoder layer's output at every step, in order: the block and the Python layer it replaces are
    compared step for step, layer by layer (one definition of the layer, checked), not only at the logits."""
    trace: list[tuple[str, list[torch.Tensor]]] = []

    def hook(module, args, out, name):
        outs = out if isinstance(out, tuple) else (out,)
        trace.append((name, [t.detach().clone() for t in outs if isinstance(t, torch.Tensor)]))

    for name, m in model.named_modules():
        if not type(m).__name__.endswith("DecoderLayer"):
            continue
        # the layer when it has a forward (Llama, V3); else (V4: the model calls its parts) the parts a block replaces
        units = [(name, m)] if type(m).forward is not torch.nn.Module.forward else \
            [(f"{name}.{part}", getattr(m, part)) for part in ("self_attn", "mlp")]
        for unit_name, unit in units:
            unit.register_forward_hook(lambda mod, a, out, n=unit_name: hook(mod, a, out, n))
    return trace


def _assert_same_bits(runs) -> None:
    on, off = runs["1"][0], runs["0"][0]
    assert len({t for toks, _ in off for t in toks}) > 8  # not a degenerate run
    for i, ((t1, lp1), (t0, lp0)) in enumerate(zip(on, off)):
        assert t1 == t0, f"prompt {i}: greedy tokens differ with the decode blocks"
        assert lp1 == lp0, f"prompt {i}: log-probs differ with the decode blocks (must be the same bits)"
    assert not any(runs["0"][1].values())  # OPENINFER_DECODE_BLOCKS=0 turns them off
    on_trace, off_trace = runs["1"][2], runs["0"][2]
    assert on_trace and [n for n, _ in on_trace] == [n for n, _ in off_trace]
    for step, ((name, a), (_, b)) in enumerate(zip(on_trace, off_trace)):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), \
            f"{name} (call {step}): the decode block's output differs from the Python layer's"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v3_blocks_same_bits_as_python_path(kernel_ops, monkeypatch, tmp_path, dtype):
    """The V3 test model (q LoRA, YaRN, group-limited sigmoid routing, one shared expert): continuous batching mixes
    decode-only steps (both blocks) with prefill steps (the MoE block only). bf16 takes the blocks where its weights
    are in panels (CPUs without native bf16); elsewhere the blocks must step aside and change nothing."""
    path = make_hf_v3(tmp_path)
    runs = _both_ways(monkeypatch, path, make_prompts((5, 17, 33, 16, 3)), dtype=str(dtype).split(".")[1])
    _assert_same_bits(runs)
    calls = runs["1"][1]
    if cpu_ops.panels_enabled(torch.device("cpu"), dtype):
        # 3 layers (1 dense, 2 MoE), 11 decode steps for 5 sequences at least once each
        assert calls["mla"] >= 3 * 11 and calls["moe"] >= 2 * 11, calls
    else:
        assert not any(calls.values())


def test_v3_variant_q_proj_softmax_two_shared(kernel_ops, monkeypatch, tmp_path):
    """The other branches the blocks take: no q LoRA (q_proj), softmax scoring, no renormalisation, two shared
    experts, no group limit."""
    path = make_hf_v3(tmp_path, seed=3, q_lora_rank=None, scoring_func="softmax", norm_topk_prob=False,
                      n_shared_experts=2, n_group=1, topk_group=1)
    runs = _both_ways(monkeypatch, path, make_prompts((40, 7, 21), seed=4), dtype="float32")
    _assert_same_bits(runs)
    assert runs["1"][1]["mla"] > 0 and runs["1"][1]["moe"] > 0


def test_fp8_cache_keeps_the_python_attention(kernel_ops, monkeypatch, tmp_path):
    """An e4m3 latent cache is written saturated and read widened by the Python path: the attention block steps
    aside (the MoE block still runs) and the results are unchanged."""
    path = make_hf_v3(tmp_path, seed=5)
    runs = _both_ways(monkeypatch, path, make_prompts((9, 30), seed=6), dtype="float32", kv_cache_dtype="fp8")
    _assert_same_bits(runs)
    assert runs["1"][1]["mla"] == 0 and runs["1"][1]["moe"] > 0


def test_v4_moe_block_same_bits(kernel_ops, monkeypatch, tmp_path):
    """DeepSeek-V4's MoE: sqrtsoftplus scoring, the SwiGLU clamp on routed and shared experts, hash-routed layers
    (those keep the Python path: the block has no token-id table)."""
    path = load_script("make_deepseek_v4_checkpoint").make_checkpoint(tmp_path / "v4", "tiny", seed=0)
    runs = _both_ways(monkeypatch, path, make_prompts((6, 19, 35), seed=7), dtype="float32")
    _assert_same_bits(runs)
    assert runs["1"][1]["moe"] > 0 and runs["1"][1]["mla"] == 0


@pytest.mark.parametrize("dtype,overrides", [
    (torch.float32, {}),
    (torch.bfloat16, {}),
    # MHA (no GQA), head dim 32 with half of it rotated, three layers
    (torch.float32, dict(num_key_value_heads=4, hidden_size=128, num_hidden_layers=3, partial_rotary_factor=0.5)),
])
def test_llama_layer_block_same_bits(kernel_ops, monkeypatch, tmp_path, dtype, overrides):
    """A Llama decoder layer as one op: every layer of every decode-only step (the first layer's residual is its
    input, the others' the running sum), prefill steps on the Python path, the same bits either way."""
    path = make_dense_checkpoint(tmp_path / "llama", seed=2, **overrides)
    runs = _both_ways(monkeypatch, path, make_prompts((5, 17, 33, 3), seed=8), dtype=str(dtype).split(".")[1])
    _assert_same_bits(runs)
    calls = runs["1"][1]
    layers = overrides.get("num_hidden_layers", 2)
    if cpu_ops.panels_enabled(torch.device("cpu"), dtype):
        assert calls["llama"] >= layers * 11 and calls["mla"] == calls["moe"] == 0, calls
    else:
        assert not any(calls.values())


@pytest.mark.parametrize("quantization,dtype", [("w4a8", "float32"), ("w4a8", "bfloat16"), ("w8a8", "float32"),
                                                ("int8", "float32"), ("int4", "bfloat16")])
def test_llama_block_runs_the_integer_kernels(kernel_ops, monkeypatch, tmp_path, quantization, dtype):
    """--quantization w4a8 / w8a8 / int8 / int4: the block calls the same low-bit kernels as QuantizedWeight.matmul
    (x widened to fp32, zero-padded to the packed width: intermediate 152 pads down_proj's K to 192 for w4a8, to 160
    for int4), the same bits."""
    path = make_dense_checkpoint(tmp_path / "llama", seed=4, intermediate_size=152)
    runs = _both_ways(monkeypatch, path, make_prompts((5, 17, 33, 3), seed=10), dtype=dtype,
                      quantization=quantization)
    _assert_same_bits(runs)
    assert runs["1"][1]["llama"] >= 2 * 11, runs["1"][1]


def test_llama_block_leaves_large_weight_only_steps_to_python(kernel_ops, monkeypatch, tmp_path):
    """Weight-only int8 decodes its matrix to fp32 for steps of LOWBIT_DEQUANT_ROWS rows or more (Python path); the
    block takes only the smaller steps. With the switch at 3 rows, four sequences decode on the Python path until
    two have finished, then in the block; the same bits as without the block."""
    monkeypatch.setitem(quant_linear.LOWBIT_DEQUANT_ROWS, "int8", 3)
    path = make_dense_checkpoint(tmp_path / "llama", seed=6)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (4, 6, 12, 14)]
    runs = _both_ways(monkeypatch, path, make_prompts((5, 17, 33, 3), seed=12), params, dtype="float32",
                      quantization="int8")
    _assert_same_bits(runs)
    calls = runs["1"][1]["llama"]
    assert 0 < calls < 2 * 13, calls  # 2 layers x (steps with <= 2 sequences), never the 4- and 3-sequence steps


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_llama_block_steps_aside_for_bias_and_qk_norm(kernel_ops, monkeypatch, tmp_path, arch):
    """Qwen2's q / k / v biases and Qwen3's per-head q / k norms are not in the block: those layers keep the Python
    path, and the results do not change."""
    path = make_dense_checkpoint(tmp_path / arch, arch=arch, seed=3)
    runs = _both_ways(monkeypatch, path, make_prompts((12, 4, 25, 9), seed=9), dtype="float32")
    _assert_same_bits(runs)
    assert runs["1"][1]["llama"] == 0


@pytest.mark.parametrize("types,runs_block,activations", [
    ({"ffn_down": "Q8_0"}, True, "auto"),
    # Q4_K_M's layer: q / k in Q4_K, v in Q6_K, so the fused projection has two kernels (each writes its columns)
    ({"attn_v": "Q6_K", "ffn_down": "Q6_K"}, True, "auto"),
    # int8 everywhere: the Q4_K / Q6_K rows repacked 8 at a time at load (GGUFWeight.repacked), in the block too
    ({"attn_v": "Q6_K", "ffn_down": "Q6_K"}, True, "int8"),
])
def test_llama_block_runs_gguf_linears(kernel_ops, monkeypatch, tmp_path, types, runs_block, activations):
    """A GGUF file's Llama layers: the block calls the GGUF kernel on the file's blocks, as GGUFWeight.matmul does;
    the same bits either way."""
    from gguf_writer import write_gguf

    monkeypatch.setenv("OPENINFER_GGUF_ACTIVATIONS", activations)
    layouts = []
    real = decode_blocks.layer_linear

    def seen(linear):  # the layouts the block is handed
        q = linear._quant
        layouts.append("dense" if q is None else getattr(q, "layout", None) or [p.layout for p in q.parts])
        return real(linear)

    monkeypatch.setattr(decode_blocks, "layer_linear", seen)

    qtype = "Q4_K" if "attn_v" in types else "Q4_1"
    path, _ = write_gguf(tmp_path, "llama", qtype, types, **(dict(hidden=256, intermediate=512)
                                                            if qtype == "Q4_K" else {}))
    runs = _both_ways(monkeypatch, path, make_prompts((5, 17, 33, 3), seed=14), max_model_len=256)
    _assert_same_bits(runs)
    calls = runs["1"][1]["llama"]
    assert (calls >= 2 * 11) if runs_block else calls == 0, calls
    want = "r8" if activations == "int8" else "file"
    assert layouts and all(set(x if isinstance(x, list) else [x]) <= {want, "file"} for x in layouts)
    assert any(want in (x if isinstance(x, list) else [x]) for x in layouts), layouts


@pytest.mark.parametrize("gguf", [False, True])
def test_llama_layer_stack_same_bits(kernel_ops, monkeypatch, tmp_path, gguf):
    """With no hooks on the layers, a decode-only step runs every Llama layer in one op (``llama_decode_layers``:
    each layer's block in order): the same greedy tokens and log-probs as
    the Python path (blocks off), and it really runs (counted). GGUF: Q4_K_M's mixed layer (q / k Q4_K, v Q6_K)."""
    if gguf:
        from gguf_writer import write_gguf
        path, _ = write_gguf(tmp_path, "llama", "Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K"}, hidden=256,
                             intermediate=512)
        kw = dict(max_model_len=256)
    else:
        path, kw = make_dense_checkpoint(tmp_path / "llama", seed=2, num_hidden_layers=3), dict(dtype="float32")
    real, calls = decode_blocks.llama_decode_stack, [0]

    def counted(*args):
        out = real(*args)
        calls[0] += out is not None
        return out

    monkeypatch.setattr(decode_blocks, "llama_decode_stack", counted)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("OPENINFER_DECODE_BLOCKS", flag)
        calls[0] = 0
        llm = LLM(str(path), enable_prefix_caching=False, num_kv_blocks=96, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts((5, 17, 33, 3), seed=8)], PARAMS,
                            use_tqdm=False)
        runs[flag] = ([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], calls[0])
    assert len({t for toks, _ in runs["0"][0] for t in toks}) > 8  # not a degenerate run
    assert runs["1"][0] == runs["0"][0]
    assert runs["1"][1] >= 11 and runs["0"][1] == 0, (runs["1"][1], runs["0"][1])
