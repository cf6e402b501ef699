"""GGUF files as checkpoints (``--model FILE.gguf``): tiny files written the way llama.cpp writes them
(``gguf_writer.py``) load through the same code a user's file goes through, keep their quantized tensors packed, and
give transformers' greedy tokens on the same weights; broken files fail with one line before any weight is read."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from gguf_writer import CHAT_TEMPLATE, write_gguf
from helpers import engine_model, hf_greedy
from openinfer import LLM, SamplingParams
from openinfer.config import ModelConfig
from openinfer.gguf_file import GGUFError, gguf_config

PROMPTS = [[5, 17, 99, 200, 3], [40, 41, 42], [120, 7, 7, 250, 33, 64, 1, 90]]
K = dict(hidden=256, intermediate=512)  # K-quant blocks hold 256 weights: rows must be a multiple


def run(path, max_tokens=10):
    llm = LLM(model=str(path), max_model_len=256, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    return llm, outs


CASES = {
    "llama-Q8_0-tied": ("llama", "Q8_0", None, {}),
    "llama-Q4_0-Q5_1": ("llama", "Q4_0", {"ffn_down": "Q5_1", "token_embd": "Q5_1"}, {}),
    # Q4_K_M's mix: Q4_K with Q6_K v / down (the fused qkv holds two types), a Q6_K embedding and head
    "llama-Q4_K_M": ("llama", "Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}, K),
    "llama-Q5_K-untied": ("llama", "Q5_K", {"output": "Q6_K"}, dict(K, tie=False)),
    "qwen2-Q4_1-untied": ("qwen2", "Q4_1", None, dict(tie=False)),
    "qwen3-Q5_0": ("qwen3", "Q5_0", {"token_embd": "Q8_0"}, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_gguf_matches_transformers_on_the_same_weights(case, tmp_path, monkeypatch):
    arch, qtype, types, kw = CASES[case]
    gguf_path, hf_dir = write_gguf(tmp_path, arch, qtype, types, **kw)
    ref = hf_greedy(hf_dir, PROMPTS, 10)
    # fp32 activations, so the file's weights are checked against transformers' fp32 model to summation order; the
    # int8-activation kernels (the default on VNNI / AVX2 builds) move these tiny random models' log-probs by up to
    # ~5e-2 and are checked against their own bounds (test_gguf_q8.py) and on real weights (test_smollm2.py)
    monkeypatch.setenv("OPENINFER_GGUF_ACTIVATIONS", "fp32")
    llm, outs = run(gguf_path)
    for out, (toks, lps) in zip(outs, ref):
        got = out.outputs[0]
        assert got.token_ids == toks
        ours = [got.logprobs[j][t] for j, t in enumerate(toks)]
        assert np.allclose(ours, lps, atol=2e-3), (ours, lps)
    # every linear (and the embedding) holds its packed blocks: nothing was dequantised at load
    from openinfer.layers.gguf_quant import GGUFWeight, GGUFWeightParts
    from openinfer.layers.linear import Linear

    model = engine_model(llm)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    packed = (GGUFWeight, GGUFWeightParts)  # parts: a fused projection whose pieces have different types
    assert linears and all(isinstance(m._quant, packed) and m.weight.numel() == 0 for m in linears)
    assert isinstance(model.model.embed_tokens._quant, GGUFWeight)


def test_folder_with_one_gguf_and_its_config(tmp_path):
    gguf_path, _ = write_gguf(tmp_path, "llama", "Q8_0")
    mc = ModelConfig.from_path(tmp_path)  # the folder: its one .gguf (hf/ has no config.json at this level)
    assert mc.gguf_file == str(gguf_path.resolve())
    assert mc.architecture == "gguf:llama" and mc.dtype == torch.float32
    cfg = mc.hf_config
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["vocab_size"]) == (64, 2, 4, 2, 16, 263)
    assert cfg["tie_word_embeddings"] is True
    with pytest.raises(ValueError, match="does not apply to a GGUF file"):
        ModelConfig.from_path(gguf_path, quantization="int8")
    (tmp_path / "other.gguf").write_bytes(gguf_path.read_bytes())
    with pytest.raises(GGUFError, match="holds 2 GGUF files"):
        ModelConfig.from_path(tmp_path)


@pytest.mark.slow
def test_tokenizer_and_chat_template_come_from_the_file(tmp_path):
    gguf_path, _ = write_gguf(tmp_path, "llama", "Q8_0")
    llm = LLM(model=str(gguf_path), max_model_len=256, num_kv_blocks=64)
    tok = llm.get_tokenizer()
    ids = tok("the cat in the hat").input_ids
    # the file's merges ("Ġ t", "h e", "Ġt he", "i n"), byte-level
    assert tok.convert_ids_to_tokens(ids) == ["t", "he", "Ġ", "c", "a", "t", "Ġ", "in", "Ġthe", "Ġ", "h", "a", "t"]
    assert tok.decode(ids) == "the cat in the hat"
    assert tok.chat_template == CHAT_TEMPLATE
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                   use_tqdm=False)[0]
    want = tok("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n").input_ids
    assert out.prompt_token_ids == want
    assert tok.convert_ids_to_tokens(want)[0] == "<|im_start|>"  # a control token, kept whole


def _corrupt(tmp_path, how):
    gguf_path, _ = write_gguf(tmp_path, "llama", "Q8_0", omit_tokenizer=(how == "no-tokenizer"))
    data = gguf_path.read_bytes()
    if how == "truncated":
        gguf_path.write_bytes(data[:len(data) * 2 // 3])
    elif how == "garbage":
        gguf_path.write_bytes(b"NOTGGUF" + data[7:])
    elif how == "unknown-type":  # one tensor stored as Q2_K, a type openinfer does not run
        _rewrite(gguf_path, data, retype={"blk.0.ffn_up.weight": "Q2_K"})
    elif how == "shape":
        _rewrite(gguf_path, data, metadata={"llama.feed_forward_length": 96})
    return gguf_path


def _rewrite(path, data, retype=None, metadata=None):
    """Copy the file with one tensor's type changed (its bytes replaced by random blocks of the new type) or one
    metadata value changed."""
    import gguf

    src_path = path.with_suffix(".src")
    src_path.write_bytes(data)
    src = gguf.GGUFReader(str(src_path))
    arch = src.fields["general.architecture"].contents()
    out = gguf.GGUFWriter(str(path), arch)
    for key, f in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (metadata or {}).get(key, f.contents())
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            out.add_key_value(key, value, vtype, sub_type=f.types[-1])
        else:
            out.add_key_value(key, value, vtype)
    rng = np.random.default_rng(0)
    for t in src.tensors:
        qtype = (retype or {}).get(t.name)
        if qtype is None:
            out.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        else:
            qt = gguf.GGMLQuantizationType[qtype]
            block, size = gguf.GGML_QUANT_SIZES[qt]
            rows, cols = int(t.shape[1]), int(t.shape[0])
            cols_p = -(-cols // block) * block
            raw = rng.integers(0, 256, size=(rows, cols_p // block * size), dtype=np.uint8)
            out.add_tensor(t.name, raw, raw_dtype=qt)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    src_path.unlink()


BAD = {
    "truncated": "truncated / corrupt",
    "garbage": "not a GGUF file",
    "unknown-type": "has type Q2_K, which openinfer does not run",
    "shape": "its metadata implies",
    "no-tokenizer": "has no tokenizer metadata",
}


@pytest.mark.parametrize("how", list(BAD))
def test_bad_files_are_one_clear_error(how, tmp_path):
    path = _corrupt(tmp_path, how)
    with pytest.raises(GGUFError, match=BAD[how]):
        gguf_config(path)


@pytest.mark.slow  # `openinfer generate` subprocesses
def test_bad_file_on_the_command_line_is_one_line_and_writes_nothing(tmp_path):
    for how in ("truncated", "unknown-type"):
        d = tmp_path / how
        path = _corrupt(d, how)
        before = sorted(p.name for p in d.iterdir())
        res = subprocess.run([sys.executable, "-m", "openinfer", "generate", "--model", str(path), "--prompt", "x"],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode != 0
        assert "Traceback" not in res.stderr and BAD[how] in res.stderr
        assert res.stdout == "" and len(res.stderr.strip().splitlines()) == 1
        assert sorted(p.name for p in d.iterdir()) == before
