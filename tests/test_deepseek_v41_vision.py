"""DeepSeek-V4.1 image input against DeepInfer's own code (its processor, ``rgb_pad_to_patches_ref``,
``batch_downsample_ref``, ``replace_input_embeds_ref``, taken from its source with ``ast``: tests/deepinfer_oracles.py)
and HF Qwen2-VL's vision RoPE (the convention DeepInfer's rope table is applied with), plus the bad-input rules."""
from __future__ import annotations

import base64
import enum
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from openinfer.models.deepseek_v41.vision import VisionTower, VisionTowerConfig
from openinfer.models.deepseek_v41.vision_inputs import ImageEmbedder, image_patches
from openinfer.multimodal.image_io import read_base64_image, read_image_url
from openinfer.multimodal.image_layout import VisionGeometry
from openinfer.multimodal.processor import expand_prompt, mm_image
from tests import deepinfer_oracles as oracles

GEOMETRY = VisionGeometry(patch_size=14, downsample_ratio=2, max_image_tokens=32, min_pixels=784, max_wh_ratio=4,
                          image_token_id=255)
# (width, height): as is; past the token budget (solved down); wider than max_wh_ratio (stretched); under
# min_pixels (scaled up).
SIZES = [(60, 40), (300, 200), (200, 30), (12, 9)]


def _png(w: int, h: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def deepinfer():
    """DeepInfer's processor class and image ops (the names its modules import from DeepInfer or PIL are
    provided; its TokenType is itself loaded from its source)."""
    tokens = oracles.load("deepinfer/multimodal_tokens.py", "TokenType", provide={"IntEnum": enum.IntEnum})
    # common.py's ImageInput is a plain (width, height, binary) dataclass; exec'd dataclasses cannot resolve their
    # module, so a stand-in of the same fields carries them.
    common = SimpleNamespace(ImageInput=lambda width, height, binary=None: SimpleNamespace(
        width=width, height=height, binary=binary), BaseProcessor=object)
    proc = oracles.load("deepinfer/ve/processor/image_processor.py", "ImageProcessorAnyRes",
                        provide={"Image": Image, "ImageOps": ImageOps, "io": io, "TokenType": tokens.TokenType,
                                 "BaseProcessor": common.BaseProcessor, "ImageInput": common.ImageInput})
    ops = oracles.op("image_embed_ops", "rgb_pad_to_patches_ref", "batch_downsample_ref", "replace_input_embeds_ref")
    return SimpleNamespace(TokenType=tokens.TokenType, ImageInput=common.ImageInput,
                           processor=proc.ImageProcessorAnyRes(None, 14, 2, torch.bfloat16, 32, 784, 4), ops=ops)


@pytest.mark.parametrize("size", SIZES)
def test_token_layout_and_resize_match_deepinfers_processor(deepinfer, size):
    """The image's positions (IMAGE_START, rows of IMAGE + IMAGE_NEWLINE, IMAGE_END), its ViT grid and the resized
    pixels equal what DeepInfer's processor makes of the same image bytes."""
    w, h = size
    data = _png(w, h)
    ref = deepinfer.processor.process(deepinfer.ImageInput(width=w, height=h, binary=data))
    ref_pixels = ref["images"][0].load().pixels
    ids, [m] = expand_prompt([7, 255, 8], [Image.open(io.BytesIO(data))], GEOMETRY)
    assert ids == [7] + [255] * m.length + [8] and m.offset == 1
    from openinfer.multimodal.image_layout import image_layout
    assert image_layout(w, h, GEOMETRY).token_types() == ref["mm_token_type"].tolist()
    assert m.length == len(ref["mm_token_type"])
    assert [m.n_vit_w, m.n_vit_h] == ref["images_spatial_crop"][0].tolist()
    assert (m.height, m.width) == tuple(ref_pixels.shape[:2])
    assert m.pixels == ref_pixels.numpy().tobytes()


def _tower(seed: int = 0) -> ImageEmbedder:
    cfg = VisionTowerConfig.from_hf({"hidden_size": 32, "downsample_ratio": 2, "num_hidden_layers": 2,
                                     "num_attention_heads": 2, "patch_size": 14, "intermediate_size": 64}, 48)
    emb = ImageEmbedder(VisionTower(cfg))
    g = torch.Generator().manual_seed(seed)
    for p in emb.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.ndim == 1 else 0.1) + (1.0 if p.ndim == 1 else 0))
    return emb


def _reference_vit(tower: VisionTower, patches: torch.Tensor, n_w: int, n_h: int) -> torch.Tensor:
    """DeepInfer's VisionTransformer forward written out in plain torch on the same weights: its rope table and
    gather (vit.py ``_rope``: columns cos_row, cos_col, sin_row, sin_col), applied as HF Qwen2-VL applies its
    vision RoPE (flash-attn's non-interleaved rotary), pre-norm blocks, SwiGLU [gate; up], final RMSNorm."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    cfg = tower.cfg
    head_dim = cfg.hidden_size // cfg.num_heads
    dim = head_dim // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.outer(torch.arange(64, dtype=torch.float), inv_freq)
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    pos = torch.stack([torch.arange(n_h)[:, None].expand(-1, n_w), torch.arange(n_w)[None].expand(n_h, -1)],
                      -1).reshape(-1, 2)
    half = freqs.shape[1]
    rope = table[pos].view(-1, 2, 2, half).transpose(1, 2).reshape(pos.shape[0], -1)
    cos, sin = rope[:, :2 * half].repeat(1, 2), rope[:, 2 * half:].repeat(1, 2)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    x = F.linear(patches.reshape(patches.shape[0], -1).float(), tower.patch_embed.weight, tower.patch_embed.bias)
    for b in tower.blocks:
        y = rms(x, b.norm1.weight)
        q, k, v = F.linear(y, b.attn.qkv.weight, b.attn.qkv.bias).view(-1, 3, cfg.num_heads, head_dim).unbind(1)
        q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / head_dim ** 0.5, -1)
        x = x + F.linear(torch.einsum("hqk,khd->qhd", att, v).reshape(x.shape), b.attn.proj.weight, b.attn.proj.bias)
        gate, up = F.linear(rms(x, b.norm2.weight), b.mlp.linear1.weight).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, b.mlp.linear2.weight)
    return rms(x, tower.fc_norm.weight)


@torch.inference_mode()
def test_vision_tower_matches_deepinfers_pieces(deepinfer):
    """Patches (DeepInfer's rgb_pad_to_patches_ref), the ViT (a plain-torch reading on the same weights), the
    d x d merge (DeepInfer's batch_downsample_ref), the aligner, and the marker placement (its
    replace_input_embeds_ref over the processor's mm_token_type) give the image positions' embeddings."""
    emb = _tower()
    img = mm_image(Image.open(io.BytesIO(_png(60, 40, seed=1))), GEOMETRY, 0)
    ops, tt = deepinfer.ops, deepinfer.TokenType
    crop = torch.tensor([[img.n_vit_w, img.n_vit_h]])
    raw = torch.frombuffer(bytearray(img.pixels), dtype=torch.uint8)
    ref_patches = ops.rgb_pad_to_patches_ref(raw, torch.tensor([0, raw.numel()]), torch.tensor([[img.width,
                                             img.height]]), crop, torch.tensor([0, img.n_vit_w * img.n_vit_h]),
                                             img.n_vit_w * img.n_vit_h, 14, 0.5, 0.5, 127.0)
    patches = image_patches(img, 14)
    assert torch.equal(patches, ref_patches)
    feats = _reference_vit(emb.tower, patches, img.n_vit_w, img.n_vit_h)
    aligned = emb.tower.aligner(ops.batch_downsample_ref(feats, crop, 2))
    types = deepinfer.processor.process(deepinfer.ImageInput(60, 40, None))["mm_token_type"]
    ref = torch.zeros(img.length, 48)
    ops.replace_input_embeds_ref(ref, types, aligned, int(tt.IMAGE),
                                 torch.tensor([int(tt.IMAGE_START), int(tt.IMAGE_END), int(tt.IMAGE_NEW_LINE)]),
                                 torch.stack([emb.image_start, emb.image_end, emb.image_newline]))
    got = emb(img)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert not torch.equal(got, emb(mm_image(Image.open(io.BytesIO(_png(60, 40, seed=2))), GEOMETRY, 0)))


def test_bad_images_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"f: .*not a data: URL or a file:// URL; openinfer fetches nothing"):
        read_image_url("https://example.com/cat.png", "f")
    with pytest.raises(ValueError, match="f: the data is not an image"):
        read_image_url("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "f")
    with pytest.raises(ValueError, match="f: the image data is not valid base64"):
        read_base64_image("@@@", "f")
    with pytest.raises(ValueError, match="media type is 'text/plain', not an image"):
        read_image_url("data:text/plain;base64,aGk=", "f")
    big = io.BytesIO()
    Image.new("1", (7000, 6000)).save(big, "PNG")  # 42M pixels, a few KB of PNG
    with pytest.raises(ValueError, match="f: the image is 7000x6000 pixels, more than 40000000"):
        read_image_url("data:image/png;base64," + base64.b64encode(big.getvalue()).decode(), "f")
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.png").write_bytes(_png(20, 20))
    (tmp_path / "b.png").write_bytes(_png(20, 20))
    with pytest.raises(ValueError, match="refused unless the server is started with --allowed-local-media-path"):
        read_image_url(f"file://{tmp_path}/ok/a.png", "f")
    with pytest.raises(ValueError, match="is not under --allowed-local-media-path"):
        read_image_url(f"file://{tmp_path}/ok/../b.png", "f", str(tmp_path / "ok"))
    assert read_image_url(f"file://{tmp_path}/ok/a.png", "f", str(tmp_path / "ok")).size == (20, 20)
    with pytest.raises(ValueError, match="2 images but 1 image placeholder"):
        expand_prompt([1, 255], [Image.new("RGB", (20, 20))] * 2, GEOMETRY)
    with pytest.raises(ValueError, match="more than the 1 allowed per prompt"):
        expand_prompt([255, 255], [Image.new("RGB", (20, 20))] * 2, GEOMETRY, limit=1)


def test_prefix_cache_keys_carry_the_image():
    """Two requests whose prompts are the same tokens but different images never share a cached block over
    or after the image; the same image does."""
    from openinfer.engine.request import Request
    from openinfer.sampling_params import SamplingParams

    ids, [a] = expand_prompt([1] * 20 + [255] + [2] * 20, [Image.open(io.BytesIO(_png(60, 40, 1)))], GEOMETRY)
    _, [b] = expand_prompt([1] * 20 + [255] + [2] * 20, [Image.open(io.BytesIO(_png(60, 40, 2)))], GEOMETRY)
    reqs = [Request(str(i), ids, SamplingParams(max_tokens=1), 256, mm_images=[m]) for i, m in enumerate((a, b, a))]

    class KV:  # the key rule of KVCacheManager, without its pools
        block_size = 16
        from openinfer.engine.kv_cache_manager import KVCacheManager
        _block_keys = KVCacheManager._block_keys

    keys = [KV()._block_keys(r, len(ids) // 16) for r in reqs]
    assert keys[0][0] == keys[1][0]  # the first block holds text only
    assert keys[0][1:] != keys[1][1:] and all(x != y for x, y in zip(keys[0][1:], keys[1][1:]))
    assert keys[0] == keys[2]


def test_text_only_serving_skips_the_tower(tmp_path):
    """--limit-mm-per-prompt '{"image": 0}': the tower is not built, its tensors are skipped (still checked by
    name), and an image prompt is refused."""
    from openinfer.config import ModelConfig
    from openinfer.engine.llm_engine import LLMEngine
    from openinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from tests.test_deepseek_v41 import _generator

    path = _generator().make_checkpoint(tmp_path / "vl", "tiny", seed=0, vision="tiny")
    mc = ModelConfig.from_path(path, dtype="float32")
    assert DeepseekV41ForCausalLM(mc.hf_config).vision is not None
    text_only = mc.with_mm_limits('{"image": 0}')
    model = DeepseekV41ForCausalLM(text_only.hf_config)
    assert model.vision is None
    from safetensors.torch import load_file
    tensors = load_file(str(path / "model.safetensors"))
    assert any(k.startswith(("vision.", "aligner.", "image_")) for k in tensors)
    loaded = model.load_weights(tensors.items())  # the vision tensors skipped, every text one loaded
    assert loaded and not any(n.startswith("vision.") for n in loaded)
    full = DeepseekV41ForCausalLM(mc.hf_config)
    assert {n for n in full.load_weights(tensors.items()) if n.startswith("vision.")} == \
        {n for n, _ in full.named_parameters() if n.startswith("vision.")}
    engine = SimpleNamespace(config=SimpleNamespace(model=text_only))
    with pytest.raises(ValueError, match="image input is off"):
        LLMEngine.place_images(engine, {"multi_modal_data": {"image": Image.new("RGB", (20, 20))}}, [255])
    with pytest.raises(ValueError, match=r"openinfer takes images only; \['video'\] must be 0"):
        mc.with_mm_limits('{"image": 1, "video": 2}')
    assert json.loads(json.dumps(mc.with_mm_limits({"image": 2, "video": 0}).limit_mm_per_prompt)) == \
        {"image": 2, "video": 0}


@torch.inference_mode()
def test_image_rows_route_with_bias_vl():
    """An image row selects its experts with ffn.gate.bias_vl in place of the text bias (DeepInfer's image_bias
    under images_seq_mask); the text rows of the same batch are untouched."""
    from openinfer.models.deepseek_v41.config import DeepseekV41Config
    from openinfer.models.deepseek_v41.moe import MoE
    from tests.test_deepseek_v41_compat import _text

    torch.manual_seed(0)
    moe = MoE(DeepseekV41Config.from_hf(_text()))
    for p in moe.parameters():
        p.copy_(torch.randn(p.shape) * 0.1)
    moe.gate.bias_vl.copy_(torch.randn(moe.gate.bias_vl.shape) * 3)  # large: image rows pick other experts
    x = torch.randn(6, moe.gate.weight.shape[1])
    rows = torch.tensor([False, True, True, False, True, False])
    mixed = moe(x, image_rows=rows)
    text = moe(x)
    text_bias = moe.gate.e_score_correction_bias.clone()
    moe.gate.e_score_correction_bias.copy_(moe.gate.bias_vl)
    as_image = moe(x)
    moe.gate.e_score_correction_bias.copy_(text_bias)
    torch.testing.assert_close(mixed[~rows], text[~rows])
    torch.testing.assert_close(mixed[rows], as_image[rows])
    assert not torch.allclose(mixed[rows], text[rows])
