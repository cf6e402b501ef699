"""How DeepSeek-V4.1 (DeepInfer 0.1.0, ``ve/processor/image_processor.py``) sizes an image and lays out its tokens.

An image of ``width x height`` pixels is resized so its sides are multiples of the ViT patch (``patch_size``), and
its token count stays within ``max_image_tokens``. Its ViT grid is ``n_vit_w x n_vit_h`` patches; the projector
merges ``downsample_ratio`` x ``downsample_ratio`` patches into one LLM token, rounding each side up, giving
``n_llm_w x n_llm_h`` image tokens. In the prompt the image becomes

    IMAGE_START, then per row (n_llm_w IMAGE tokens, IMAGE_NEWLINE), then IMAGE_END

i.e. ``n_llm_h * (n_llm_w + 1) + 2`` positions. Every rounding below decides a token count, so each follows
DeepInfer's arithmetic step for step (tests/test_deepseek_v41_vision.py compares with DeepInfer's own functions).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class TokenType(enum.IntEnum):
    """DeepInfer's ``multimodal_tokens.TokenType`` values (its wire format), for the positions of one image."""

    IMAGE = 2
    IMAGE_START = 3
    IMAGE_END = 4
    IMAGE_NEW_LINE = 5


@dataclass(frozen=True)
class VisionGeometry:
    """The image settings of a checkpoint's config.json (``vision_config`` and the top-level ``image_token_id``)."""

    patch_size: int
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: float | None
    image_token_id: int

    @staticmethod
    def takes_images(hf_config: dict) -> bool:
        """A checkpoint whose images openinfer can place: DeepSeek-V4.1 with its vision_config (another model's
        vision_config describes a tower openinfer does not build)."""
        from openinfer.models.registry import IMAGE_ARCHITECTURES  # the models package knows its classes

        archs = hf_config.get("architectures") or [""]
        return archs[0] in IMAGE_ARCHITECTURES and isinstance(hf_config.get("vision_config"), dict)

    @classmethod
    def from_hf(cls, hf_config: dict) -> VisionGeometry:
        if not cls.takes_images(hf_config):
            raise ValueError("this model takes no image input (openinfer takes images for DeepSeek-V4.1 "
                             "checkpoints with a vision_config)")
        vc = hf_config["vision_config"]

        def positive(d: dict, key: str, where: str) -> int:
            v = d.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{where}{key} must be a positive int, got {v!r}")
            return v

        ratio = vc.get("max_wh_ratio")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio < 1):
            raise ValueError(f"vision_config.max_wh_ratio must be null or >= 1, got {ratio!r}")
        min_pixels = vc.get("min_pixels", 0)
        if not isinstance(min_pixels, int) or min_pixels < 0:
            raise ValueError(f"vision_config.min_pixels must be an int >= 0, got {min_pixels!r}")
        return cls(patch_size=positive(vc, "patch_size", "vision_config."),
                   downsample_ratio=positive(vc, "downsample_ratio", "vision_config."),
                   max_image_tokens=positive(vc, "max_image_tokens", "vision_config."),
                   min_pixels=min_pixels, max_wh_ratio=ratio,
                   image_token_id=positive(hf_config, "image_token_id", ""))


@dataclass(frozen=True)
class ImageLayout:
    best_width: int  # the resize target, a multiple of patch_size each side
    best_height: int
    n_vit_w: int
    n_vit_h: int
    n_llm_w: int
    n_llm_h: int

    @property
    def num_tokens(self) -> int:
        return self.n_llm_h * (self.n_llm_w + 1) + 2

    def token_types(self) -> list[int]:
        row = [TokenType.IMAGE] * self.n_llm_w + [TokenType.IMAGE_NEW_LINE]
        return [int(t) for t in [TokenType.IMAGE_START, *(row * self.n_llm_h), TokenType.IMAGE_END]]


def _from_pixels(width: int, height: int, patch: int, ratio: int) -> ImageLayout:
    n_vit_w, n_vit_h = width // patch, height // patch
    return ImageLayout(width, height, n_vit_w, n_vit_h, -(-n_vit_w // ratio), -(-n_vit_h // ratio))


def _fit_token_budget(height: int, width: int, patch: int, ratio: int, max_tokens: int) -> ImageLayout:
    """The largest grid with the image's aspect ratio whose h * (w + 1) + 2 tokens fit ``max_tokens``: with
    r = h / w, w = sqrt((max - 2) / r + 1/4) - 1/2; a side that comes out below one token is pinned to one."""
    r = height / width
    w_float = math.sqrt((max_tokens - 2) / r + 0.25) - 0.5
    h_float = w_float * r
    cell = patch * ratio
    if w_float < 1.0:
        h = (max_tokens - 2) // 2
        return _from_pixels(cell, h * cell, patch, ratio)
    if h_float < 1.0:
        w = (max_tokens - 2) - 1
        return _from_pixels(w * cell, cell, patch, ratio)
    w, h = math.floor(w_float), math.floor(h_float)
    beta = min(w * cell / width, h * cell / height)
    return _from_pixels(math.floor(width * beta / patch) * patch, math.floor(height * beta / patch) * patch,
                        patch, ratio)


def image_layout(width: int, height: int, g: VisionGeometry) -> ImageLayout:
    """The resize target and token grid of a ``width x height`` image (DeepInfer's ``compute_image_layout``)."""
    if g.max_wh_ratio is not None and width > height * g.max_wh_ratio:
        width = height * g.max_wh_ratio  # very wide: the width is clamped and the resize stretches
    pixels = width * height
    if 0 < pixels < g.min_pixels:  # too small: scaled up keeping the aspect ratio
        scale = (g.min_pixels / pixels) ** 0.5
        width, height = int(width * scale), int(height * scale)
    p = g.patch_size
    layout = _from_pixels(math.ceil(width / p) * p, math.ceil(height / p) * p, p, g.downsample_ratio)
    if layout.num_tokens > g.max_image_tokens:
        layout = _fit_token_budget(height, width, p, g.downsample_ratio, g.max_image_tokens)
    return layout


def stretched(width: int, height: int, g: VisionGeometry) -> bool:
    """Whether the width was clamped by ``max_wh_ratio`` (the resize then stretches instead of fitting inside)."""
    return g.max_wh_ratio is not None and width >= g.max_wh_ratio * height
