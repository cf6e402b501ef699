"""DeepSeek-V4.1 config / checkpoint fields read as DeepInfer 0.1.0 reads them (hugging_face/config.py, names.py):
DSpark blocks' compress_ratios entries ignored, a type-less rope_scaling is YaRN, ``hc_shifted: false`` refused
naming the field, per-block ``mtp.N.embed / head`` copies skipped, and every tensor name the tiny checkpoint writer
produces maps where DeepInfer's names.py maps it."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from tests import deepinfer_oracles as oracles
from tests.test_deepseek_v41 import _generator


def _text(**overrides) -> dict:
    gen = _generator()
    text = {**gen.COMMON, **gen.SIZES["tiny"], **overrides}
    text.pop("engram_compressed_vocab_size")  # needs a checkpoint directory's tokenizer.json
    return text


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _generator().make_checkpoint(tmp_path_factory.mktemp("v41c") / "tiny", "tiny", seed=0)


def _model(path) -> DeepseekV41ForCausalLM:
    cfg = json.loads((path / "config.json").read_text())
    return DeepseekV41ForCausalLM({**cfg, "_checkpoint_dir": str(path)})


def _tensors(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


@pytest.mark.parametrize("entry", [1, 2, 4])
def test_dspark_compress_ratio_entries_are_ignored(entry):
    """DeepInfer builds every DSpark block sliding-window only, whatever its compress_ratios entry
    (_dflash_spec); openinfer crashed building the block (or refused 4)."""
    text = _text()
    text["compress_ratios"] = text["compress_ratios"][:-1] + [entry]
    model = DeepseekV41ForCausalLM(text)
    n = model.config.num_hidden_layers
    assert model.config.compress_ratios[n:] == (0,)
    drafter = model.build_mtp()
    assert drafter is model.mtp and len(drafter) == 1


def test_rope_scaling_without_type_is_yarn():
    """DeepInfer applies YaRN to compressed layers whenever rope_scaling is set (_compress_spec)."""
    typed = DeepseekV41Config.from_hf(_text())
    scaling = {k: v for k, v in _text()["rope_scaling"].items() if k != "type"}
    untyped = DeepseekV41Config.from_hf(_text(rope_scaling=scaling))
    assert untyped.compress_rope == typed.compress_rope
    assert untyped.compress_rope.factor == 4.0
    assert untyped.main_rope == typed.main_rope  # sliding-window layers keep plain RoPE


def test_hc_shifted_false_is_refused_naming_the_field():
    assert DeepseekV41Config.from_hf(_text(hc_shifted=True)).hc_mult == 4
    with pytest.raises(ValueError, match="hc_shifted=False"):
        DeepseekV41Config.from_hf(_text(hc_shifted=False))


def test_mtp_embed_and_head_copies_are_skipped(ckpt):
    """DeepInfer's names.py maps mtp.N.embed / head to nothing (tied to the backbone's) and its loader skips them;
    openinfer rejected them as not belonging to the model."""
    model = _model(ckpt)
    extra = [("mtp.0.embed.weight", torch.randn(256, 128).bfloat16()),
             ("mtp.0.head.weight", torch.randn(256, 128).bfloat16())]
    model.load_weights([*_tensors(ckpt), *extra])
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:  # the backbone's copies stay in use
        torch.testing.assert_close(model.lm_head.weight, f.get_tensor("head.weight").float())
    names = oracles.names_module()  # last: skips where DeepInfer's source is unavailable
    assert names.hf_to_model("mtp.0.embed.weight", n_layer=8) is None
    assert names.hf_to_model("mtp.0.head.weight", n_layer=8) is None


def test_checkpoint_names_are_deepinfers(ckpt):
    """Every tensor the tiny checkpoint writer produces maps, under DeepInfer's names.py, to a known internal
    parameter (a listed suffix, or a routed expert's w1/w2/w3), and each FP8 weight's scale is named by its
    scale_name; the names openinfer's loader accepts are exactly those."""
    names = oracles.names_module()
    known = {*names._HF_TO_MODEL_SUFFIX, *names._HF_TO_EMBED_SUFFIX, *names._HF_TO_HEAD_SUFFIX,
             *names._HF_TO_MTP_EXTRA}
    expert = re.compile(r"^ffn\.experts\.\d+\.w[123]\.weight$")
    n_layer = json.loads((ckpt / "config.json").read_text())["text_config"]["num_hidden_layers"]
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        all_names = set(f.keys())
    weights = {n for n in all_names if not n.endswith(".scale")}
    for n in sorted(all_names - weights):
        owner = n.removesuffix(".scale") + ".weight"
        assert owner in weights and names.scale_name(owner) == n, n
    unknown = []
    for n in sorted(weights):
        assert names.hf_to_model(n, n_layer=n_layer) is not None, n
        suffix = re.sub(r"^(layers|mtp)\.\d+\.", "", n)
        if suffix not in known and not expert.match(suffix):
            unknown.append(n)
    assert unknown == []
    # The scoring bias of image tokens (bias_vl) is in both.
    assert "layers.2.ffn.gate.bias_vl" in weights


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    """The same text weights (same seed, written first) plus DeepInfer's vision layout at a test width."""
    return _generator().make_checkpoint(tmp_path_factory.mktemp("v41vl") / "tiny", "tiny", seed=0, vision="tiny")


def test_vision_layout_is_deepinfers():
    """The writer's full-size vision tower is DeepInfer's fixed ViT (vision_encoder/vit.py constants), and every
    vision name maps under names.py into DeepInfer's vision_pipeline tree."""
    gen = _generator()
    vit = oracles.load("deepinfer/model_executor/models/vision_encoder/vit.py", "EMBED_DIM", "DEPTH", "NUM_HEADS",
                       "MLP_RATIO", "MULTIPLE_OF", "PATCH_SIZE")
    full = gen.VISION["deepinfer"]
    mlp = vit.MULTIPLE_OF * -(-int(vit.EMBED_DIM * vit.MLP_RATIO) // vit.MULTIPLE_OF)
    assert (full["hidden_size"], full["depth"], full["num_attention_heads"], full["patch_size"], full["mlp_hidden"]) \
        == (vit.EMBED_DIM, vit.DEPTH, vit.NUM_HEADS, vit.PATCH_SIZE, mlp)
    names = oracles.names_module()
    specs = gen.vision_specs(gen.VISION["tiny"], 128)
    mapped = {names.hf_to_model(n, n_layer=8) for n in specs}
    block = {f"vision_pipeline.aligner.visual_encoder.blocks.{i}.{leaf}" for i in range(2)
             for leaf in ("norm1.weight", "norm2.weight", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                          "attn.proj.bias", "mlp.linear1.weight", "mlp.linear2.weight")}
    assert mapped == block | {
        "vision_pipeline.aligner.visual_encoder.patch_embed.proj.weight",
        "vision_pipeline.aligner.visual_encoder.patch_embed.proj.bias",
        "vision_pipeline.aligner.visual_encoder.fc_norm.weight",
        *(f"vision_pipeline.aligner.aligner.layers.{i}.{k}" for i in (0, 2) for k in ("weight", "bias")),
        *(f"module.module.0.params.image_{k}" for k in ("start", "end", "newline"))}


def test_checkpoint_with_the_vision_tower_serves_text(ckpt, vl_ckpt):
    """DeepInfer's released layout (vision_config, vision.* / aligner.* / image_* tensors) loads (the tower built)
    and serves text with exactly the tokens of the text-only checkpoint."""
    from openinfer import LLM, SamplingParams
    cfg = json.loads((vl_ckpt / "config.json").read_text())
    assert cfg["vision_config"]["hidden_size"] == 32
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 33, 7, 81, 12, 40]}, {"prompt_token_ids": list(range(20, 45))}]
    outs = []
    for path in (ckpt, vl_ckpt):
        llm = LLM(str(path), dtype="float32", max_model_len=64, num_kv_blocks=16)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
        del llm
    assert outs[0] == outs[1]


def test_bad_vision_tensors_fail_naming_them(vl_ckpt):
    from openinfer.models.weights import WeightLoadError
    model = _model(vl_ckpt)
    with pytest.raises(WeightLoadError, match=r"'image_start' has shape \(7,\)"):
        model.load_weights([("image_start", torch.zeros(7))])
    with pytest.raises(WeightLoadError, match="vision.blocks.0.attn.qkv.weight"):  # not DeepInfer's HF name
        model.load_weights([("vision.blocks.0.attn.qkv.weight", torch.zeros(96, 32))])
    cfg = json.loads((vl_ckpt / "config.json").read_text())
    del cfg["vision_config"]
    text_only = DeepseekV41ForCausalLM({**cfg, "_checkpoint_dir": str(vl_ckpt)})
    with pytest.raises(WeightLoadError, match="no vision_config"):
        text_only.load_weights([("vision.norm.weight", torch.zeros(32))])
    with pytest.raises(ValueError, match="vision_config.downsample_ratio must be a positive int"):
        DeepseekV41Config.from_hf({**_text(), "vision_config": {"hidden_size": 32}})


def test_config_json_has_every_key_deepinfer_reads(vl_ckpt):
    """The writer's config.json (with vision_config) goes through DeepInfer's own config builders
    (hugging_face/config.py: support checks, sharing topology, attention specs, MoE, DSpark, Engram, vision), and
    holds every key its load_hf_model_config reads directly (found in its source)."""
    import ast
    attrdict = oracles.load("deepinfer/attrdict.py", "AttrDict").AttrDict
    rel = "deepinfer/hugging_face/config.py"
    di = oracles.load(rel, "_assert_supported", "_shared_layer_cfg", "_build_attn_module_list", "_build_moe",
                      "_build_dflash_cfg", "_build_engram", "_build_vision", "_n_prefill_layer",
                      provide={"AttrDict": attrdict})
    hf = json.loads((vl_ckpt / "config.json").read_text())
    text = hf["text_config"]
    di._assert_supported(hf)
    shared = di._shared_layer_cfg(text)
    specs = di._build_attn_module_list(text, shared)
    n = text["num_hidden_layers"]
    assert [0 if s.cfg.get("sparse_stage") == 0 else s.cfg.kv_compress_ratio for s in specs[:n]] == \
        text["compress_ratios"][:n]
    assert di._n_prefill_layer(text) == 5
    assert di._build_moe(text).n_routed_experts == text["n_routed_experts"]
    assert di._build_dflash_cfg(hf).dspark_block_size == text["dspark_block_size"]
    assert di._build_engram(hf, vl_ckpt).engram_layer_ids == text["engram_layer_ids"]
    assert di._build_vision(hf)[1].params.input_dim == hf["vision_config"]["hidden_size"]
    # DeepInfer's image processor settings (hugging_face/processor.py), as openinfer's geometry reads them.
    from openinfer.multimodal.image_layout import VisionGeometry
    proc = oracles.load("deepinfer/hugging_face/processor.py", "load_processor_config").load_processor_config(vl_ckpt)
    g = VisionGeometry.from_hf(hf)
    assert (g.patch_size, g.downsample_ratio, g.max_image_tokens, g.min_pixels, g.max_wh_ratio, g.image_token_id) \
        == tuple(proc[k] for k in ("patch_size", "downsample_ratio", "max_image_tokens", "min_pixels",
                                   "max_wh_ratio", "image_token_id"))
    source = ast.parse((oracles.source_root() / rel).read_text())
    fn = next(f for f in source.body if isinstance(f, ast.FunctionDef) and f.name == "load_hf_model_config")
    scopes = {"hf": hf, "text": text, "quant": hf["quantization_config"]}
    read = {(node.value.id, node.slice.value) for node in ast.walk(fn)
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in scopes
            and isinstance(node.slice, ast.Constant)}
    assert len(read) > 20  # the scan found the reads (29 in 0.1.0)
    assert sorted(f"{scope}[{key!r}]" for scope, key in read if key not in scopes[scope]) == []
