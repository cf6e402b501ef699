"""Rotary position embeddings, once for every model: frequencies (plain, linear, Llama-3, YaRN), cos/sin, and the
two ways checkpoints lay the rotated pairs out.

Frequencies and angles follow transformers' ``_compute_*_parameters`` and rotary modules in fp32 (fp32 inverse
frequencies, fp32 position x frequency products), so cos/sin match HF bit for bit. Layouts:
- ``apply_neox``: "rotate half" on the leading rotary dims (Llama, Qwen; DeepSeek-V3 without ``rope_interleave``).
- ``apply_interleaved``: adjacent pairs (x0, x1), (x2, x3), ... on the trailing rotary dims (DeepSeek). V3's HF
  port writes the result de-interleaved ([evens' | odds']: q and k get the same permutation, so q.k is
  unchanged); V4 keeps the pairs in place and also de-rotates its attention output (``inverse``).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from openinfer.layers import cpu_ops

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Normalise the two config styles: transformers 5 ``rope_parameters`` and legacy ``rope_theta`` +
    ``rope_scaling``."""
    params = dict(hf_config.get("rope_parameters") or {})
    if "rope_theta" not in params:
        params["rope_theta"] = hf_config.get("rope_theta", 10000.0)
    scaling = hf_config.get("rope_scaling") or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    return params


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_attention_factor(rot_dim: int, params: dict[str, Any],
                                  max_position: int | None = None) -> tuple[torch.Tensor, float]:
    """fp32 inverse frequencies [rot_dim // 2] and the factor cos/sin are scaled by (YaRN's mscale; else 1)."""
    kind = params.get("rope_type", "default")
    base = float(params["rope_theta"])
    pos_freqs = base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    inv_freq = 1.0 / pos_freqs
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(rot_dim, params, base, pos_freqs, max_position)
    raise ValueError(f"rope_type={kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def _yarn(dim: int, params: dict[str, Any], base: float, pos_freqs: torch.Tensor,
          max_position: int | None) -> tuple[torch.Tensor, float]:
    """HF ``_compute_yarn_parameters``: NTK-by-parts frequencies and the cos/sin attention factor."""
    orig = params.get("original_max_position_embeddings")
    if not orig:
        raise ValueError("rope_scaling yarn needs original_max_position_embeddings")
    factor = params.get("factor")
    if not factor:
        if not max_position:
            raise ValueError("rope_scaling yarn needs a factor")
        factor = max_position / orig
    factor = float(factor)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_get_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(qk_head_dim: int, params: dict[str, Any]) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (HF ``yarn_apply_mscale``)."""
    scale = qk_head_dim ** -0.5
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = yarn_get_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale


class RotaryEmbedding(nn.Module):
    """cos/sin [T, rot_dim // 2] (fp32, times the attention factor) for a step's positions.

    With ``max_position`` the values come from tables built once (``cos`` / ``sin`` buffers, which the fused CPU
    rotary kernel also reads); without it they are computed per call (DeepSeek-V4 allows 1M positions: a table
    would be hundreds of MB). One instance is shared by the layers that use it, so a step's rows are gathered or
    computed once (memoised on the positions tensor itself)."""

    def __init__(self, rot_dim: int, params: dict[str, Any], max_position: int | None = None) -> None:
        super().__init__()
        if rot_dim % 2:
            raise ValueError(f"rotary dims must be even, got {rot_dim}")
        self.rot_dim = rot_dim
        inv_freq, self.attention_factor = inv_freq_and_attention_factor(rot_dim, params, max_position)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        cos = sin = None
        if max_position is not None:
            cos, sin = self._compute(torch.arange(max_position, dtype=torch.float32))
        self.register_buffer("cos", cos, persistent=False)  # None: computed per call
        self.register_buffer("sin", sin, persistent=False)
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.float()
        if self.attention_factor == 1.0:
            return freqs.cos(), freqs.sin()
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is not None and self._last[0] is positions:
            return self._last[1], self._last[2]
        cos, sin = (self.cos[positions], self.sin[positions]) if self.cos is not None else self._compute(positions)
        self._last = (positions, cos, sin)
        return cos, sin


def _broadcast(cos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """cos [T, R/2] -> [T, 1, ..., R/2] against x [T, ..., D]."""
    return cos.reshape((cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],))


def apply_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half on the leading ``2 * cos.shape[-1]`` dims of x [T, ..., D] (the rest passes through)."""
    rd = 2 * cos.shape[-1]
    c, s = _broadcast(cos, x), _broadcast(sin, x)
    xr = x[..., :rd].float()
    x1, x2 = xr.chunk(2, dim=-1)
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return rotated if rd == x.shape[-1] else torch.cat((rotated, x[..., rd:]), dim=-1)


def apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
                      deinterleave: bool = False) -> torch.Tensor:
    """Rotate adjacent pairs on the trailing ``2 * cos.shape[-1]`` dims of x [T, ..., D] (the rest passes
    through). ``inverse`` de-rotates; ``deinterleave`` writes the rotated dims as [evens' | odds']. On the CPU
    one kernel op does it (cpu_ops.rope_interleaved, same bits) in place of the ~10 torch ops below."""
    fast = cpu_ops.rope_interleaved(x, cos, sin, inverse, deinterleave)
    if fast is not None:
        return fast
    rd = 2 * cos.shape[-1]
    c, s = _broadcast(cos, x), _broadcast(sin, x)
    if inverse:
        s = -s
    xr = x[..., -rd:].float()
    even, odd = xr[..., 0::2], xr[..., 1::2]
    a, b = even * c - odd * s, odd * c + even * s
    rotated = (torch.cat((a, b), dim=-1) if deinterleave else torch.stack((a, b), dim=-1).flatten(-2)).to(x.dtype)
    return rotated if rd == x.shape[-1] else torch.cat((x[..., :-rd], rotated), dim=-1)
