"""DeepInfer's checkpoint names of the vision tower (``hugging_face/names.py``: ``vision.*`` -> its
``vision_pipeline.aligner.visual_encoder.*``, ``aligner.*`` -> ``...aligner.layers.*``, ``image_*`` -> the
embedding stage's ``params.image_*``) -> this model's ``vision.*`` parameters (vision_inputs.ImageEmbedder)."""
from __future__ import annotations

import re

VISION_TENSOR = re.compile(r"^(model\.)?(vision\.(patch_embed\.proj\.(weight|bias)|norm\.weight"
                           r"|blocks\.\d+\.(norm1\.weight|norm2\.weight|attn\.(wqkv|wo)\.(weight|bias)"
                           r"|mlp\.(w1|w2)\.weight))|aligner\.(w1|w2)\.(weight|bias))$")
IMAGE_MARKERS = ("image_start", "image_end", "image_newline")
# HF leaf fragment -> this model's (the same renames as names.py's _VISION_RENAME, onto vision.py's modules).
_RENAMES = ((".attn.wqkv.", ".attn.qkv."), (".attn.wo.", ".attn.proj."), (".mlp.w1.", ".mlp.linear1."),
            (".mlp.w2.", ".mlp.linear2."))


def is_vision_tensor(name: str) -> bool:
    plain = name.removeprefix("model.")
    return plain in IMAGE_MARKERS or bool(VISION_TENSOR.match(plain))


def vision_param_name(name: str) -> str:
    """A name ``is_vision_tensor`` accepted -> the parameter of DeepseekV41ForCausalLM it loads into."""
    plain = name.removeprefix("model.")
    if plain in IMAGE_MARKERS:
        return f"vision.{plain}"
    if plain.startswith("aligner."):
        return "vision.tower.aligner." + plain[len("aligner."):].replace("w1.", "0.", 1).replace("w2.", "2.", 1)
    if plain == "vision.norm.weight":
        return "vision.tower.fc_norm.weight"
    if plain.startswith("vision.patch_embed.proj."):
        return "vision.tower.patch_embed." + plain.rsplit(".", 1)[1]
    for old, new in _RENAMES:
        plain = plain.replace(old, new)
    return "vision.tower." + plain[len("vision."):]
