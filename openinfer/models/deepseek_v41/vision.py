"""DeepSeek-V4.1's vision tower, from DeepInfer 0.1.0's definitions (``vision_encoder/vit.py``, ``mlp_projector.py``,
``vl_aligner.py``, ``tilelang_ops/image_embed_ops.py``), in plain torch.

  patches [n, 3, p, p] -> Linear(3p^2, E) -> blocks: x += attn(rms1(x)); x += swiglu(rms2(x)) -> rms(x)
  attention: one qkv Linear (bias), 2D RoPE over the patch's (row, column), full (non-causal) attention within
  the image, out Linear (bias); SwiGLU: Linear(E, 2M) = [gate; up], silu(gate) * up, Linear(M, E)
  then each d x d patch cell (zero-padded at the grid's right / bottom) is concatenated channel-major
  (F.unfold's order) and projected: Linear(E d^2, D) -> GELU -> Linear(D, D).

The 2D RoPE: a head's dims split in halves rotated as pairs (i, i + head_dim/2) (TileKernels' non-interleaved
``apply_rotary``, which DeepInfer calls with its table's first half as cos, second as sin); the first quarter of
frequencies turns with the patch row, the second with the column (DeepInfer's rope table columns (cos_row, cos_col,
sin_row, sin_col)); this is HF Qwen2-VL's vision RoPE, which tests/test_deepseek_v41_vision.py uses as its
reference.

DeepInfer fixes the ViT's shape in constants (patch 14, width 1024, 32 blocks, 16 heads, MLP 2.7x rounded up to
a multiple of 128); config.json's ``vision_config`` may restate them (``num_hidden_layers``,
``num_attention_heads``, ``intermediate_size``; the tiny test checkpoint does) and otherwise they are DeepInfer's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# DeepInfer's vision_encoder/vit.py constants.
NORM_EPS = 1e-6
PATCH_SIZE, EMBED_DIM, DEPTH, NUM_HEADS, MLP_RATIO, MULTIPLE_OF = 14, 1024, 32, 16, 2.7, 128
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class VisionTowerConfig:
    hidden_size: int
    depth: int
    num_heads: int
    mlp_hidden: int
    patch_size: int
    downsample_ratio: int
    text_hidden: int

    @classmethod
    def from_hf(cls, vc: dict, text_hidden: int) -> VisionTowerConfig:
        e = int(vc.get("hidden_size", EMBED_DIM))
        mlp = vc.get("intermediate_size")
        if mlp is None:
            mlp = MULTIPLE_OF * -(-int(e * MLP_RATIO) // MULTIPLE_OF)
        heads = int(vc.get("num_attention_heads", NUM_HEADS))
        if e % heads or (e // heads) % 4:
            raise ValueError(f"vision_config: hidden_size={e} over num_attention_heads={heads} must give a head "
                             "width divisible by 4 (2D RoPE over rows and columns)")
        return cls(e, int(vc.get("num_hidden_layers", DEPTH)), heads, int(mlp),
                   int(vc.get("patch_size", PATCH_SIZE)), int(vc["downsample_ratio"]), text_hidden)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS) * self.weight.float()).to(x.dtype)


def rope_cos_sin(grid_h: int, grid_w: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [h*w, head_dim] for the patches in scanline order (row-major)."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32, device=device)
                                     / (2 * quarter)))
    rows = torch.arange(grid_h, device=device, dtype=torch.float32).repeat_interleave(grid_w)
    cols = torch.arange(grid_w, device=device, dtype=torch.float32).repeat(grid_h)
    freqs = torch.cat([torch.outer(rows, inv_freq), torch.outer(cols, inv_freq)], dim=-1)  # [n, head_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim]; pairs (i, i + head_dim/2) rotated, in fp32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, dim = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.heads, dim // self.heads).unbind(1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.proj(out.transpose(0, 1).reshape(n, dim))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.linear1 = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear1(x).chunk(2, dim=-1)
        return self.linear2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.norm2 = RMSNorm(cfg.hidden_size)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.mlp_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


def downsample(features: torch.Tensor, grid_w: int, grid_h: int, d: int) -> torch.Tensor:
    """[h*w, E] patch features -> [ceil(h/d) * ceil(w/d), E*d*d]: each d x d cell's features concatenated
    channel-major (F.unfold's order), the grid zero-padded at its right and bottom."""
    e = features.shape[-1]
    grid = features.reshape(grid_h, grid_w, e)
    grid = F.pad(grid, (0, 0, 0, -grid_w % d, 0, -grid_h % d))
    nh, nw = grid.shape[0] // d, grid.shape[1] // d
    cells = grid.reshape(nh, d, nw, d, e).permute(0, 2, 4, 1, 3)  # [nh, nw, E, d, d]
    return cells.reshape(nh * nw, e * d * d)


class VisionTower(nn.Module):
    """ViT + projector: ``forward(patches, grid_w, grid_h)`` -> [n_llm_h * n_llm_w, text hidden], one image."""

    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e = cfg.hidden_size
        self.patch_embed = nn.Linear(3 * cfg.patch_size * cfg.patch_size, e)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.fc_norm = RMSNorm(e)
        d = cfg.downsample_ratio
        self.aligner = nn.Sequential(nn.Linear(e * d * d, cfg.text_hidden), nn.GELU(),
                                     nn.Linear(cfg.text_hidden, cfg.text_hidden))
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, patches: torch.Tensor, grid_w: int, grid_h: int) -> torch.Tensor:
        x = self.patch_embed(patches.reshape(patches.shape[0], -1).to(self.patch_embed.weight.dtype))
        cos, sin = rope_cos_sin(grid_h, grid_w, self.cfg.hidden_size // self.cfg.num_heads, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        x = self.fc_norm(x)
        return self.aligner(downsample(x, grid_w, grid_h, self.cfg.downsample_ratio))
