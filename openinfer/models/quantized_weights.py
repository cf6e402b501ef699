"""Quantised checkpoint weights paired with their scales and dequantised at load (DeepSeek-V3 and V4 alike).

- FP8 e4m3 linears with one multiplier per ``weight_block_size`` block (``layers/fp8.py``), under either name:
  ``X.weight_scale_inv`` (HF-converted) or ``X.scale`` (DeepSeek's release); fp32 or UE8M0 scales.
  A linear the model's loader names in ``keep_packed`` (``packs_fp8``) comes out as an ``Fp8Weight`` instead: the
  codes and multipliers as shipped, for ``Linear.load_quantized``.
- MXFP4 routed experts (V4-Flash ``expert_dtype: fp4``): int8-packed E2M1 + UE8M0 per 32 (``layers/mxfp4.py``),
  scale named like the FP8 ones. Those ``keep_packed`` names come out as an ``Mxfp4Tensor`` (the pair, shapes
  checked) instead, for the experts that keep them packed.
A weight and its scale may sit in different shards, in any order: each is held until its partner arrives. The
result is fp32; copying it into a parameter casts it once to the model dtype (the math is fp32 either way).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from openinfer.layers.fp8 import FP8_DTYPE, Fp8Weight, dequantize_fp8_block, packed_fp8_enabled
from openinfer.layers.linear import Linear
from openinfer.layers.mxfp4 import PACKED_DTYPES, Mxfp4Tensor, check_mxfp4, dequantize_mxfp4
from openinfer.models.weights import WeightLoadError, materialize

SCALE_SUFFIXES = (".weight_scale_inv", ".scale")


def scale_owner(name: str) -> str | None:
    """``X.weight`` for a scale name ``X.weight_scale_inv`` / ``X.scale``, else None."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)] + ".weight"
    return None


def packs_fp8(module: torch.nn.Module | None, block: tuple[int, int] | None) -> bool:
    """Whether an FP8 checkpoint weight of ``module`` stays packed (``Fp8Weight``): a ``Linear`` on the CPU that
    only multiplies (``prepack``: nothing reads its weight as a matrix), not split over tensor-parallel ranks,
    with a block width the kernel takes, unless ``OPENINFER_FP8_WEIGHTS=dequantize``."""
    if block is None or block[1] % 8 or not isinstance(module, Linear) or not module.prepack:
        return False
    if module.weight.device.type != "cpu" or getattr(getattr(module, "tp", None), "world_size", 1) != 1:
        return False
    return packed_fp8_enabled()


class Dequantizer:
    """Feed every checkpoint tensor through ``feed``: plain tensors pass straight through (still lazy); a quantised
    weight comes out dequantised (fp32, under its weight name) once both it and its scale have been fed. ``finish``
    raises for anything left unpaired."""

    def __init__(self, fp8_block: tuple[int, int] | None, expert_dtype: str | None,
                 is_param: Callable[[str], bool], keep_packed: Callable[[str], bool] = lambda name: False) -> None:
        self.fp8_block = fp8_block  # from config.json's quantization_config (None: not FP8-quantised)
        self.expert_dtype = expert_dtype  # "fp4": MXFP4 routed experts
        self.is_param = is_param  # a ".scale" that names a model parameter is not a quantisation scale
        self.keep_packed = keep_packed  # a weight its layer keeps packed (V4's MXFP4 experts, FP8 linears)
        self.weights: dict[str, torch.Tensor] = {}
        self.scales: dict[str, tuple[str, torch.Tensor]] = {}

    def feed(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        owner = scale_owner(name)
        if owner is not None and not self.is_param(name):
            key = owner
            self.scales[key] = (name, materialize(tensor))
        elif tensor.dtype == FP8_DTYPE or (tensor.dtype in PACKED_DTYPES and name.endswith(".weight")):
            self._check_declared(name, tensor)
            key = name
            self.weights[key] = materialize(tensor)
        else:
            yield name, tensor
            return
        if key in self.weights and key in self.scales:
            yield key, self._dequantize(key, self.weights.pop(key), self.scales.pop(key)[1])

    def finish(self) -> None:
        if self.weights or self.scales:
            raise WeightLoadError(
                "quantised weights without a scale (.weight_scale_inv or .scale): "
                f"{sorted(self.weights)[:5]}; scales without a weight: "
                f"{sorted(n for n, _ in self.scales.values())[:5]}")

    def _check_declared(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype == FP8_DTYPE and self.fp8_block is None:
            raise WeightLoadError(f"tensor {name!r} is float8 but config.json has no fp8 quantization_config")
        if tensor.dtype in PACKED_DTYPES and self.expert_dtype != "fp4":
            raise WeightLoadError(f"tensor {name!r} is {tensor.dtype} (packed MXFP4) but config.json "
                                  f"declares expert_dtype={self.expert_dtype!r}, not 'fp4'")

    def _dequantize(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | Mxfp4Tensor:
        try:
            if weight.dtype in PACKED_DTYPES and self.keep_packed(name):
                check_mxfp4(weight, scale)
                return Mxfp4Tensor(weight, scale)
            if weight.dtype == FP8_DTYPE and self.keep_packed(name):
                return Fp8Weight.from_checkpoint(weight, scale, self.fp8_block)
            if weight.dtype == FP8_DTYPE:
                return dequantize_fp8_block(weight, scale, self.fp8_block, torch.float32)
            return dequantize_mxfp4(weight, scale, torch.float32)
        except ValueError as e:
            raise WeightLoadError(f"tensor {name!r}: {e}") from None
