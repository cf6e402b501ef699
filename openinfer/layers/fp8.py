"""FP8 e4m3 block-quantised weights (DeepSeek-V3 / V4 style): kept as shipped (``Fp8Weight``, run by
``cpu_kernels/fp8_gemm.cpp``) or dequantised once at load.

DeepSeek ships linear weights as ``float8_e4m3fn [N, K]`` plus one multiplier per ``[bn, bk]`` block
(``[ceil(N/bn), ceil(K/bk)]``, bn = bk = 128; the last block row/column may be ragged): ``w = fp8 * scale``.
HF-converted checkpoints call the multiplier ``weight_scale_inv``, DeepSeek's own release ``scale``; it is
fp32 (V3, V4-Flash-Base) or UE8M0 (``scale_fmt: ue8m0``, V4-Flash: ``float8_e8m0fnu`` = 2^(byte-127)).
On the CPU the linears the loaders hand over (``models/quantized_weights.py``: single-rank, read only through
their matmul) stay as the checkpoint's bytes, decoded in registers by the kernel: a quarter of fp32's bytes per
step. Everything else (GPUs, whose FP8 GEMMs we do not rely on, tensor-parallel slices, weights other code reads
as matrices such as MLA's ``kv_b_proj``, ``OPENINFER_FP8_WEIGHTS=dequantize``) is dequantised at load as before.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from openinfer.layers import dispatch
from openinfer.layers.quant_linear import QuantizedWeight, decoded_matmul

FP8_DTYPE = torch.float8_e4m3fn
E8M0_DTYPE = torch.float8_e8m0fnu
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)
SCALE_FORMATS = ("float32", "ue8m0")


def fp8_block_size(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """The weight block size if the checkpoint is FP8 block-quantised, None if it is not quantised.

    Raises ValueError naming the field for quantisation schemes we cannot load."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported (supported: fp8)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r} is not supported (supported: e4m3)")
    if qc.get("scale_fmt") not in (None, "fp32", *SCALE_FORMATS):
        raise ValueError(f"quantization_config.scale_fmt={qc['scale_fmt']!r} is not supported "
                         f"(supported: {', '.join(SCALE_FORMATS)})")
    block = qc.get("weight_block_size") or list(DEFAULT_BLOCK)
    if len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block):
        raise ValueError(f"quantization_config.weight_block_size={block!r} must be two positive ints")
    return int(block[0]), int(block[1])


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A block scale in fp32: float tensors as they are, UE8M0 (``float8_e8m0fnu``) as 2^(byte-127) exactly.
    Integer tensors are rejected: raw exponent bytes and integer multipliers cannot be told apart."""
    if scale.dtype == E8M0_DTYPE or scale.dtype.is_floating_point:
        return scale.float()
    raise ValueError(f"scale dtype {scale.dtype} is not a float or float8_e8m0fnu scale")


def _expand_scale(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    n, k = shape
    bn, bk = block
    return scale_to_float(scale_inv).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] = DEFAULT_BLOCK,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """weight [N, K] fp8 + scale_inv [ceil(N/bn), ceil(K/bk)] -> [N, K] in ``dtype`` (math in fp32)."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block weights must be 2-D, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}; a [{n}, {k}] weight in "
                         f"{bn}x{bk} blocks needs {want}")
    return (weight.float() * _expand_scale(scale_inv, (n, k), block)).to(dtype)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                       scale_fmt: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse used by checkpoint generators and tests: per-block amax / 448 scales, e4m3 values.
    ``scale_fmt="ue8m0"`` rounds each scale up to a power of two and returns it as ``float8_e8m0fnu``."""
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt={scale_fmt!r} is not one of {SCALE_FORMATS}")
    n, k = weight.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))
    scale_inv = (amax / FP8_MAX).clamp(min=1e-12)  # all-zero blocks still get a finite scale
    if scale_fmt == "ue8m0":
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    q = (weight.float() / _expand_scale(scale_inv, (n, k), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv.to(E8M0_DTYPE) if scale_fmt == "ue8m0" else scale_inv


# From this many activation rows on (prefill) the matrix is decoded for the call (in row chunks:
# quant_linear.decoded_matmul) and multiplied by torch's blocked fp32 GEMM. scripts/packed_rows.py --format fp8
# (2048 x 2048, 1 thread, AVX2 EPYC, loaded host, time / oneDNN's on the dequantised copy): kernel 0.87 / 1.30 / 1.78 / 1.70 at 8 / 32 / 64 / 128 rows, decoded + GEMM 6.1 / 1.84 / 1.45
# / 1.25: the register tile wins up to 32 rows, the decoded copy from 64.
FP8_DEQUANT_ROWS = 64


def packed_fp8_enabled() -> bool:
    """Whether FP8 linears stay packed (``KernelConfig.fp8_weights``; ``OPENINFER_FP8_WEIGHTS=dequantize``
    dequantises them at load, the old path)."""
    return dispatch.active().fp8_packed


class Fp8Weight(QuantizedWeight):
    """One FP8 block-quantised matrix ``[N, K]`` as the checkpoint ships it (``cpu_kernels/fp8_gemm.cpp`` says
    the layout): the e4m3 codes as uint8 ``[N, Kp]`` (K padded to 8 with +0 codes) and each row's block
    multipliers as fp32 ``[N, ceil(K / bk)]``. Usable wherever a ``QuantizedWeight`` is (``Linear._quant``,
    ``weight_bytes``). ``matmul`` runs the C++ kernel on the CPU, else the torch reference (this matrix
    dequantised for the call, fp32 matmul); the kernel's weights are the reference's bit for bit. From
    ``FP8_DEQUANT_ROWS`` rows on the kernel decodes the matrix for the call instead (prefill)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype,
                 bk: int) -> None:
        super().__init__("fp8", qweight, scales, shape, dtype, bk)

    @classmethod
    def from_checkpoint(cls, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                        dtype: torch.dtype = torch.float32) -> Fp8Weight:
        """weight float8_e4m3fn [N, K] + its [ceil(N / bn), ceil(K / bk)] multipliers (fp32 or UE8M0)."""
        if weight.dim() != 2 or weight.dtype != FP8_DTYPE:
            raise ValueError(f"an FP8 weight must be 2-D float8_e4m3fn, got {weight.dtype} {tuple(weight.shape)}")
        n, k = weight.shape
        bn, bk = block
        if bk % 8:
            raise ValueError(f"weight_block_size [{bn}, {bk}]: the FP8 kernel needs a block width divisible by 8")
        want = (-(-n // bn), -(-k // bk))
        if tuple(scale_inv.shape) != want:
            raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}; a [{n}, {k}] weight in "
                             f"{bn}x{bk} blocks needs {want}")
        codes = weight.contiguous().view(torch.uint8)
        if bool(((codes & 0x7F) == 0x7F).any()):
            raise ValueError("the FP8 weight holds NaN codes (0x7f / 0xff)")
        kp = -(-k // 8) * 8
        q = codes if kp == k else F.pad(codes, (0, kp - k))
        scales = scale_to_float(scale_inv).repeat_interleave(bn, 0)[:n].contiguous()
        return cls(q.contiguous(), scales, (n, k), dtype, bk)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: ``dequantize_fp8_block``'s values exactly."""
        n, k = self.shape
        codes = self.qweight[:, :k].contiguous().view(FP8_DTYPE)
        return codes.float() * self.scales.repeat_interleave(self.group, 1)[:, :k]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._padded_kernel_matmul(x, bias, self.qweight.shape[1], self._run)

    def _run(self, ops, xf: torch.Tensor) -> torch.Tensor:
        n = self.shape[0]
        if xf.shape[0] >= FP8_DEQUANT_ROWS:
            return decoded_matmul(xf, n, lambda out, n0, n1: ops.fp8_dequantize(out, self.qweight[n0:n1],
                                                                                self.scales[n0:n1], self.group))
        y = torch.empty(xf.shape[0], n, dtype=torch.float32)
        ops.fp8_linear(y, xf, self.qweight, self.scales, self.group)
        return y

    def load_rows(self, row: int, src: Fp8Weight) -> None:
        """Rows ``row:row + src rows`` from a checkpoint matrix (an expert's gate or up into its fused w13)."""
        rows = src.shape[0]
        if row < 0 or row + rows > self.shape[0] or (src.shape[1], src.group) != (self.shape[1], self.group):
            raise ValueError(f"FP8 weight of shape {tuple(src.shape)} (block width {src.group}) does not fit rows "
                             f"{row}:{row + rows} of a [{self.shape[0]}, {self.shape[1]}] weight (block width "
                             f"{self.group})")
        self.qweight[row:row + rows].copy_(src.qweight)
        self.scales[row:row + rows].copy_(src.scales)

    @classmethod
    def cat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row-wise concatenation (gate and up into the fused projection): rows carry their own multipliers, so
        any row counts fuse."""
        first = parts[0]
        for p in parts[1:]:
            if not isinstance(p, Fp8Weight) or (p.group, p.shape[1], p.qweight.shape[1]) != \
                    (first.group, first.shape[1], first.qweight.shape[1]):
                raise ValueError(f"cannot fuse FP8 parts of different layouts: {tuple(first.shape)} and "
                                 f"{getattr(p, 'method', None)} {tuple(p.shape)}")
        if len(parts) == 1:
            return first
        return cls(torch.cat([p.qweight for p in parts]).contiguous(), torch.cat([p.scales for p in parts]),
                   (sum(p.shape[0] for p in parts), first.shape[1]), first.dtype, first.group)


def stacked_fp8(count: int, n: int, k: int, bk: int, dtype: torch.dtype) -> list[Fp8Weight]:
    """``count`` zero [N, K] FP8 matrices as views of one stacked buffer each for codes and multipliers (the layout
    of a stacked ``[E, N, K]`` expert parameter: a quarter of fp32's bytes plus 4 per row and block)."""
    q = torch.zeros(count, n, -(-k // 8) * 8, dtype=torch.uint8)
    s = torch.ones(count, n, -(-k // bk), dtype=torch.float32)
    return [Fp8Weight(q[e], s[e], (n, k), dtype, bk) for e in range(count)]
