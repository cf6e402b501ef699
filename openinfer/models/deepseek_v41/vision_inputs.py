"""An image's prompt positions as embeddings: the resized RGB bytes padded onto the ViT grid and cut into patches
(DeepInfer's ``rgb_pad_to_patches``), the tower's output, and the image marker embeddings placed as DeepInfer's
``replace_input_embeds`` places them (``image_start`` first, ``image_newline`` after each row, ``image_end`` last).
"""
from __future__ import annotations

import torch
from torch import nn

from openinfer.models.deepseek_v41.vision import VisionTower
from openinfer.step_io import MMImage

# DeepInfer's processor normalises every channel with mean = std = 0.5 (hugging_face/processor.py: no config key)
# and pads with the mean's byte value, truncated: int(0.5 * 255) = 127.
PIXEL_MEAN = PIXEL_STD = 0.5
PAD_BYTE = int(PIXEL_MEAN * 255)


def pixel_table() -> torch.Tensor:
    """uint8 -> normalised value, computed in fp32 on the CPU and rounded to bf16 (the patches' dtype in
    DeepInfer, whatever the model dtype)."""
    return ((torch.arange(256, dtype=torch.float32) / 255.0 - PIXEL_MEAN) / PIXEL_STD).to(torch.bfloat16)


def image_patches(img: MMImage, patch: int) -> torch.Tensor:
    """[n_vit_h * n_vit_w, 3, patch, patch] bf16, scanline order; the image centred on a grid-sized canvas of the
    pad colour."""
    grid_w, grid_h = img.n_vit_w * patch, img.n_vit_h * patch
    if img.width > grid_w or img.height > grid_h or len(img.pixels) != img.width * img.height * 3:
        raise ValueError(f"image of {img.width}x{img.height} ({len(img.pixels)} bytes) does not fit its "
                         f"{grid_w}x{grid_h} grid")
    canvas = torch.full((grid_h, grid_w, 3), PAD_BYTE, dtype=torch.uint8)
    left, top = round((grid_w - img.width) * 0.5), round((grid_h - img.height) * 0.5)
    pixels = torch.frombuffer(bytearray(img.pixels), dtype=torch.uint8).view(img.height, img.width, 3)
    canvas[top:top + img.height, left:left + img.width] = pixels
    chw = pixel_table()[canvas.permute(2, 0, 1).long()]
    return (chw.reshape(3, img.n_vit_h, patch, img.n_vit_w, patch).permute(1, 3, 0, 2, 4)
            .reshape(img.n_vit_h * img.n_vit_w, 3, patch, patch))


class ImageEmbedder(nn.Module):
    """The tower plus the three marker embeddings (checkpoint ``image_start / image_end / image_newline``)."""

    def __init__(self, tower: VisionTower) -> None:
        super().__init__()
        self.tower = tower
        d = tower.cfg.text_hidden
        self.image_start = nn.Parameter(torch.zeros(d), requires_grad=False)
        self.image_end = nn.Parameter(torch.zeros(d), requires_grad=False)
        self.image_newline = nn.Parameter(torch.zeros(d), requires_grad=False)

    @torch.inference_mode()
    def forward(self, img: MMImage) -> torch.Tensor:
        """[img.length, text hidden]: the embeddings of the image's prompt positions."""
        cfg = self.tower.cfg
        dev = self.image_start.device
        feats = self.tower(image_patches(img, cfg.patch_size).to(dev), img.n_vit_w, img.n_vit_h)
        n_w, n_h = -(-img.n_vit_w // cfg.downsample_ratio), -(-img.n_vit_h // cfg.downsample_ratio)
        if img.length != n_h * (n_w + 1) + 2:
            raise ValueError(f"image spans {img.length} prompt positions, its {n_w}x{n_h} token grid needs "
                             f"{n_h * (n_w + 1) + 2}")
        rows = feats.to(self.image_start.dtype).view(n_h, n_w, -1)
        newline = self.image_newline.view(1, 1, -1).expand(n_h, 1, -1)
        body = torch.cat([rows, newline], dim=1).reshape(n_h * (n_w + 1), -1)
        return torch.cat([self.image_start[None], body, self.image_end[None]])
