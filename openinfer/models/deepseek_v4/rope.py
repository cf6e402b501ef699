"""V4 RoPE: interleaved (GPT-J) pairs on the *trailing* ``rope_dim`` channels, optional YaRN, inverse rotation.

cos/sin are computed per call from the positions (no max_position table: V4-Flash allows 1M positions).
Frequencies follow transformers' ``_compute_yarn_parameters`` in fp32 so parity with HF is exact.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from openinfer.models.deepseek_v4.config import RopeConfig


def inv_freq_for(rope: RopeConfig) -> torch.Tensor:
    dim = rope.rope_dim
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv = 1.0 / pos_freqs
    if rope.factor is None:
        return inv

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv / rope.factor * (1 - extrapolation) + inv * extrapolation


class V4Rotary(nn.Module):
    def __init__(self, rope: RopeConfig) -> None:
        super().__init__()
        self.rope_dim = rope.rope_dim
        self.attention_factor = rope.attention_factor
        self.register_buffer("inv_freq", inv_freq_for(rope), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., rope_dim // 2] in fp32."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of x [T, ..., D]; cos/sin [T, rd/2] broadcast over the
    middle dims. ``inverse`` de-rotates (V4 applies it to the attention output, since V == K carries rope)."""
    rd = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        s = -s
    rope = x[..., -rd:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rotated.to(x.dtype)], dim=-1)
