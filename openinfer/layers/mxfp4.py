"""MXFP4 weights (DeepSeek-V4-Flash routed experts, ``expert_dtype: fp4``): kept packed (``Mxfp4Weight``, run by
``cpu_kernels/mxfp4_gemm.cpp``) or dequantised once at load (``dequantize_mxfp4``; ``OPENINFER_MXFP4_EXPERTS``).

Storage (spec §3): ``int8 [N, K/2]``, two E2M1 values per byte, the **low nibble holding the lower-index
element**; plus one UE8M0 scale (``float8_e8m0fnu``, 2^(byte-127)) per 32 consecutive elements of a row,
``[N, K/32]``. A nibble is sign (bit 3) and a 3-bit magnitude index into E2M1_VALUES; ``w = value * scale``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from openinfer.layers import dispatch
from openinfer.layers.fp8 import E8M0_DTYPE, scale_to_float
from openinfer.layers.quant_linear import QuantizedWeight

MXFP4_BLOCK = 32
# Nibble -> value: 0..7 positive, 8..15 the same magnitudes negated (8 is -0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
PACKED_DTYPES = (torch.int8, torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed [N, K/2] int8/uint8 + scale [N, K/32] (UE8M0 or float) -> [N, K] in ``dtype`` (math in fp32)."""
    n, k = _check_shapes(packed, scale)
    b = packed.view(torch.uint8).long()
    nibbles = torch.stack([b & 0xF, b >> 4], dim=-1).view(n, k)  # low nibble first
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)[nibbles]
    return (values * scale_to_float(scale).repeat_interleave(MXFP4_BLOCK, 1)[:, :k]).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for checkpoint generators and tests: a power-of-two scale per 32 values (the smallest that
    keeps the block's amax <= 6), each value rounded to the nearest E2M1 magnitude. K must be even."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"MXFP4 packs two values per byte; K={k} is odd")
    blocks = -(-k // MXFP4_BLOCK)
    padded = torch.zeros(n, blocks * MXFP4_BLOCK, dtype=torch.float32)
    padded[:, :k] = weight.float()
    amax = padded.view(n, blocks, MXFP4_BLOCK).abs().amax(dim=-1).clamp(min=2.0 ** -120)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E2M1_MAX)))
    x = weight.float() / scale.repeat_interleave(MXFP4_BLOCK, 1)[:, :k]
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    index = (x.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # ties -> the smaller magnitude
    nibbles = index | ((x < 0) & (index > 0)).long() << 3
    pairs = nibbles.view(n, k // 2, 2)
    packed = (pairs[..., 0] | pairs[..., 1] << 4).to(torch.uint8).view(torch.int8)
    return packed, scale.to(E8M0_DTYPE)


# ---- kept packed: the experts' bytes as loaded, multiplied by cpu_kernels/mxfp4_gemm.cpp -----------------------

_KERNEL_HALF = MXFP4_BLOCK // 2  # columns per nibble half of a packed block in the kernel's layout


def packed_experts_enabled() -> bool:
    """``OPENINFER_MXFP4_EXPERTS=dequantize`` dequantises MXFP4 experts at load instead of keeping them packed
    (the path before packed experts existed: to measure against, or to bisect). Default ``packed``."""
    return dispatch.active().mxfp4_packed


class Mxfp4Tensor(NamedTuple):
    """A checkpoint's MXFP4 weight and its scale, handed to the layer that keeps them packed (checked shapes)."""

    packed: torch.Tensor  # int8/uint8 [N, K/2], low nibble = lower-index element
    scale: torch.Tensor  # UE8M0 [N, ceil(K/32)]

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2


def _check_shapes(packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """The [N, K/2] codes and their [N, ceil(K/32)] scales agree; returns (N, K)."""
    if packed.dtype not in PACKED_DTYPES or packed.dim() != 2:
        raise ValueError(f"MXFP4 weights must be 2-D int8/uint8, got {packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    want = (n, -(-k // MXFP4_BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale has shape {tuple(scale.shape)}; a packed [{n}, {k // 2}] MXFP4 weight "
                         f"({k} values per row, blocks of {MXFP4_BLOCK}) needs {want}")
    return n, k


def check_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> None:
    _check_shapes(packed, scale)
    if scale.dtype != E8M0_DTYPE:
        raise ValueError(f"an MXFP4 scale kept packed must be float8_e8m0fnu, got {scale.dtype}")


def to_kernel_layout(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint order -> the kernel's (``mxfp4_gemm.cpp``): K padded to a multiple of 32 with +0 nibbles; in each
    block of 32 columns byte i = column i | column i + 16 << 4. -> (uint8 [N, Kp/2], UE8M0 bytes uint8 [N, Kp/32])."""
    check_mxfp4(packed, scale)
    n, k = packed.shape[0], packed.shape[1] * 2
    blocks = scale.shape[1]
    b = packed.view(torch.uint8)
    nibbles = torch.zeros(n, blocks * MXFP4_BLOCK, dtype=torch.uint8)
    nibbles[:, :k] = torch.stack([b & 0xF, b >> 4], dim=-1).view(n, k)
    halves = nibbles.view(n, blocks, 2, _KERNEL_HALF)
    q = (halves[:, :, 0] | halves[:, :, 1] << 4).reshape(n, blocks * _KERNEL_HALF)
    return q.contiguous(), scale.view(torch.uint8).contiguous()


def dequantize_kernel_layout(qweight: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """The torch reference of the kernel: its layout dequantised to fp32 [N, k] (``dequantize_mxfp4``'s values)."""
    n, blocks = scales.shape
    b = qweight.view(n, blocks, _KERNEL_HALF)
    nibbles = torch.cat([b & 0xF, b >> 4], dim=-1).long()  # [N, blocks, 32] in column order
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=qweight.device)[nibbles]
    return (values * scale_to_float(scales.view(E8M0_DTYPE))[..., None]).view(n, -1)[:, :k]


class Mxfp4Weight(QuantizedWeight):
    """One MXFP4 matrix ``[N, K]`` in the kernel's layout (``to_kernel_layout``); usable wherever a
    ``QuantizedWeight`` is (the experts' per-expert loop, ``weight_bytes``). ``matmul`` runs the C++ kernel on
    the CPU, else (``OPENINFER_CPU_KERNELS=0``, a GPU tensor, no compiler) the torch reference: this matrix
    dequantised for the call and multiplied in fp32."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int],
                 dtype: torch.dtype) -> None:
        super().__init__("mxfp4", qweight, scales, shape, dtype, MXFP4_BLOCK)

    @classmethod
    def from_checkpoint(cls, packed: torch.Tensor, scale: torch.Tensor,
                        dtype: torch.dtype = torch.bfloat16) -> Mxfp4Weight:
        q, s = to_kernel_layout(packed, scale)
        return cls(q, s, (packed.shape[0], packed.shape[1] * 2), dtype)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel()  # one byte each

    def dequantize(self) -> torch.Tensor:
        return dequantize_kernel_layout(self.qweight, self.scales, self.shape[1])

    def load_rows(self, row: int, src: Mxfp4Tensor) -> None:
        """Rows ``row:row + src rows`` from a checkpoint tensor (a slice of a stacked or fused matrix)."""
        q, s = to_kernel_layout(src.packed, src.scale)
        rows = q.shape[0]
        if row < 0 or row + rows > self.shape[0] or q.shape[1] != self.qweight.shape[1]:
            raise ValueError(f"MXFP4 tensor of shape {src.shape} does not fit rows {row}:{row + rows} of a "
                             f"[{self.shape[0]}, {self.shape[1]}] weight")
        self.qweight[row:row + rows].copy_(q)
        self.scales[row:row + rows].copy_(s)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._padded_kernel_matmul(x, bias, self.qweight.shape[1] * 2, self._run)

    def _run(self, ops, xf: torch.Tensor) -> torch.Tensor:
        y = torch.empty(xf.shape[0], self.shape[0], dtype=torch.float32)
        ops.mxfp4_linear(y, xf, self.qweight, self.scales)
        return y


def stacked_mxfp4(count: int, n: int, k: int, dtype: torch.dtype) -> list[Mxfp4Weight]:
    """``count`` zero [N, K] MXFP4 matrices as views of one stacked uint8 buffer each for codes and scales (the
    layout of a stacked ``[E, N, K]`` expert parameter, a quarter of bf16's bytes plus one per 32 values)."""
    blocks = -(-k // MXFP4_BLOCK)
    q = torch.zeros(count, n, blocks * _KERNEL_HALF, dtype=torch.uint8)
    s = torch.full((count, n, blocks), 127, dtype=torch.uint8)  # 2^0
    return [Mxfp4Weight(q[e], s[e], (n, k), dtype) for e in range(count)]
