"""An image prompt as DeepSeek-V4.1 takes it: each image placeholder token (config.json ``image_token_id``, the
tokenizer's ``<｜deepseek_image｜>`` / ``<image>``) becomes the image's positions (image_layout.py), and each image
is resized as DeepInfer's processor resizes it (Pillow's ``ImageOps.contain`` to the layout's target, or a
stretching ``resize`` for a width clamped by ``max_wh_ratio``). The placeholder id fills the image's positions
in the token list (their embeddings are the vision tower's); ``MMImage`` carries the pixels and where they go."""
from __future__ import annotations

import hashlib

import numpy as np
from PIL import Image, ImageOps

from openinfer.multimodal.image_layout import ImageLayout, VisionGeometry, image_layout, stretched
from openinfer.step_io import MMImage


def resize_image(image: Image.Image, g: VisionGeometry) -> tuple[ImageLayout, Image.Image]:
    w, h = image.size
    layout = image_layout(w, h, g)
    target = (layout.best_width, layout.best_height)
    if stretched(w, h, g):
        return layout, image.resize(target)
    try:
        return layout, ImageOps.contain(image, target)
    except ValueError:  # an extreme aspect ratio rounds the short side to 0 pixels: stretch instead
        return layout, image.resize(target)


def mm_image(image: Image.Image, g: VisionGeometry, offset: int = 0) -> MMImage:
    layout, resized = resize_image(image.convert("RGB"), g)
    pixels = np.ascontiguousarray(np.asarray(resized, dtype=np.uint8)).tobytes()
    w, h = resized.size
    digest = hashlib.sha256(f"{w}x{h}:".encode() + pixels).hexdigest()
    return MMImage(offset, layout.num_tokens, layout.n_vit_w, layout.n_vit_h, w, h, pixels, digest)


def expand_prompt(token_ids: list[int], images: list[Image.Image], g: VisionGeometry,
                  limit: int | None = None) -> tuple[list[int], list[MMImage]]:
    """The prompt with its first ``len(images)`` placeholders expanded, and the images placed there. Placeholders
    beyond the images stay ordinary tokens (as in DeepInfer)."""
    if limit is not None and len(images) > limit:
        raise ValueError(f"the prompt has {len(images)} images, more than the {limit} allowed per prompt "
                         f"(--limit-mm-per-prompt)")
    places = [i for i, t in enumerate(token_ids) if t == g.image_token_id][:len(images)]
    if len(places) < len(images):
        raise ValueError(f"the prompt has {len(images)} images but {len(places)} image placeholder tokens "
                         f"(id {g.image_token_id})")
    out: list[int] = []
    placed: list[MMImage] = []
    cursor = 0
    for image, at in zip(images, places):
        out.extend(token_ids[cursor:at])
        m = mm_image(image, g, len(out))
        placed.append(m)
        out.extend([g.image_token_id] * m.length)
        cursor = at + 1
    out.extend(token_ids[cursor:])
    return out, placed
