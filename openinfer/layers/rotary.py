"""Rotary position embeddings (NeoX "rotate half" layout, as Llama/Qwen checkpoints use)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


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


def _inv_freq(rot_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
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
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type={kind!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any], rot_dim: int | None = None):
        super().__init__()
        self.rot_dim = rot_dim or head_dim
        inv_freq = _inv_freq(self.rot_dim, params)
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        # Kept in fp32 and cast per call: bf16 cos/sin tables lose accuracy at long positions.
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D]; returns rotated copies."""
        cos, sin = self._cos_sin(positions)
        return self._apply(q, cos, sin), self._apply(k, cos, sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] (any heads, e.g. q and k side by side); returns a rotated copy."""
        cos, sin = self._cos_sin(positions)
        return self._apply(x, cos, sin)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One instance is shared by all layers of a model, so the cos/sin rows are gathered once per step
        (keyed on the positions tensor itself)."""
        if self._last is not None and self._last[0] is positions:
            return self._last[1], self._last[2]
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        self._last = (positions, cos, sin)
        return cos, sin

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rot_dim
        xr = x[..., :rd].float()
        x1, x2 = xr.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        if rd == x.shape[-1]:
            return rotated
        return torch.cat((rotated, x[..., rd:]), dim=-1)
