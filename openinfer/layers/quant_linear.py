"""Weight-only low-bit linears, quantised at load (``--quantization int8 | int4``) and executed packed.

- ``int8``: symmetric, one fp32 scale per output channel (``s = amax(|w_n|) / 127``, q = round(w / s)).
  Resident weight bytes: N x K + 4 N, about half of bf16's.
- ``w8a8``: the weight as ``int8``; the activations too, per token, quantised dynamically in each call (symmetric,
  ``s_m = amax(|x_m|) / 127``), so the dot products are int8 x int8 -> int32 (``cpu_kernels/w8a8_gemm.cpp``), scaled
  by s_m * s_n to fp32: vLLM / SGLang's CPU W8A8 and compressed-tensors ``int-quantized`` checkpoints.
  Checkpoint weights may hold -128 (llm-compressor's range is [-128, 127]); ours are [-127, 127].
- ``int4``: symmetric, one fp32 scale per output channel and group of ``INT4_GROUP`` input columns
  (``s = amax / 7``, q in [-7, 7], stored as q + 8 in a nibble), two per byte in the kernel's order
  (``cpu_kernels/lowbit_gemm.cpp``: in each run of 16 columns, byte i = column i | column i + 8 << 4); K is padded
  to a multiple of 16 with zeros. About a quarter of bf16's bytes plus 4 bytes per group.
- ``w4a8``: the weight quantised as ``int4`` (K padded to a multiple of 64), its bytes then laid out in blocks of 4
  rows: [ceil(N / 4), Kp / 64, 4, 32] (the 32 bytes of each row's 64 columns side by side, rows past N zero), so
  the kernel reads the matrix as one front-to-back stream (the per-row layout gave it 4 short streams per block:
  ~10 GB/s at batch 1 from memory); the activations quantised per token as in ``w8a8``, so each group's dot
  product is int4 x int8 -> int32 (``cpu_kernels/w4a8_gemm.cpp``), scaled by s_m and the group's scale: llama.cpp's
  Q4_0 x Q8_0 on CPUs, which the weight-only ``int4`` (every nibble widened to fp32) trails at batch 1 on AVX2.

A ``QuantizedWeight`` replaces a ``Linear``'s weight (``Linear._quant``); ``matmul`` runs the C++ kernel on the
CPU, else (``OPENINFER_CPU_KERNELS=0``, a GPU tensor, no compiler) the torch reference: the rows are dequantised
on the fly for that call and multiplied in fp32. Both compute x W^T in fp32 and round to x's dtype once; they
differ only in summation order.

All-zero rows/groups get scale 1 (q = 0), never a 0 or NaN scale.

Asymmetric int4 (AWQ, GPTQ ``sym=false`` checkpoints: ``w = (q - z) * s`` with a zero point z per row and group)
runs on the same kernel, the nibbles as they are: sum_k x_k (q_k - z) s = sum_k x_k (q_k - 8) s + s (8 - z) xg,
xg the sum of x over the group. So ``zero_corr`` = (s (8 - z))^T, fp32 [G, N], holds the difference, and the kernel
path adds xg @ zero_corr to the kernel's result (a matmul G = K / group deep; [G, N] rather than [N, G] because that
operand order is what keeps it cheap at M = 1: ~7 us against ~30 us per linear on the AVX2 dev host). The torch
reference instead dequantises (q - 8) s + zero_corr^T, which is exactly (q - z) s in fp32 when s is an fp16 / bf16
value (as checkpoints store it): every term is a small integer times s's mantissa (11 bits at most), so no sum rounds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from openinfer.layers import cpu_ops
from openinfer.quantization_config import QUANTIZATION_METHODS

INT4_GROUP = 128  # input columns per int4 scale (llama.cpp's Q4_0 uses 32, GPTQ/AWQ 128)
_INT4_RUN = 16  # columns per packed run (the kernel's vector layout)
W4A8_STEP = 64  # w4a8: K is padded to, and groups are multiples of, the 64 columns of one 32-byte weight load
W4A8_ROWS = 4  # w4a8: output rows per block of the packed layout (the kernel's register tile)
# From this many activation rows on (prefill) int8 / int4 decode the matrix to fp32 for the call (``int8_dequantize``
# / ``int4_dequantize``) and run torch's blocked GEMM on it: the register tile re-widens every weight for each pair
# of rows, so from a few dozen rows it trails a GEMM. scripts/packed_rows.py, 1 thread, quiet AVX2 EPYC, ms kernel /
# decoded + GEMM: int8 5632 x 1024 at 32 / 64 / 128 / 512 rows 6.6 / 7.3, 13.2 / 12.2, 27.0 / 21.3, 114.5 / 75.6,
# 1024 x 2816 at 32 / 48 / 64 3.5 / 3.9, 5.2 / 5.1, 7.2 / 6.9; int4 5632 x 1024 at 16 / 32 / 128 / 512 4.8 / 5.5,
# 9.5 / 8.0, 50.1 / 26.1, 160.6 / 76.8, 1024 x 2816 at 16 / 24 / 32 2.3 / 2.4, 3.5 / 3.0, 5.0 / 3.6.
LOWBIT_DEQUANT_ROWS = {"int8": 48, "int4": 24}
# The decoded copy is made in row chunks of about this many bytes: bounded extra memory on big matrices (a 32000 x
# 4096 head would need 512 MiB at once), and each chunk is still in the last-level cache when the GEMM reads it.
DEQUANT_CHUNK_BYTES = 8 << 20


def decoded_matmul(x: torch.Tensor, n: int, decode) -> torch.Tensor:
    """fp32 ``x [M, K] @ W^T`` with W (``[n, K]``) decoded to fp32 in row chunks by ``decode(out, n0, n1)``, which
    fills ``out [n1 - n0, K]`` with rows n0:n1 (a kernel's ``*_dequantize`` on those rows)."""
    k = x.shape[1]
    rows = max(64, DEQUANT_CHUNK_BYTES // (4 * max(k, 1)))
    if rows >= n:
        w = torch.empty(n, k, dtype=torch.float32)
        decode(w, 0, n)
        return F.linear(x, w)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    buf = torch.empty(rows, k, dtype=torch.float32)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        w = buf[:n1 - n0]
        decode(w, n0, n1)
        y[:, n0:n1] = F.linear(x, w)
    return y


class QuantizedWeight:
    """One packed weight ``[N, K]`` and its scales; ``matmul(x, bias)`` = x W^T + bias."""

    def __init__(self, method: str, qweight: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int],
                 dtype: torch.dtype, group: int = 0, zero_corr: torch.Tensor | None = None) -> None:
        self.method = method
        self.qweight = qweight
        self.scales = scales
        self.shape = torch.Size(shape)  # the logical [N, K]
        self.dtype = dtype  # what the dense weight was (dequantised weights come back in it)
        self.group = group
        # int4 with zero points: fp32 [G, N] = (s (8 - z))^T, ``scales`` transposed (None: symmetric, z = 8)
        if zero_corr is not None and (method != "int4" or zero_corr.shape != scales.t().shape
                                      or zero_corr.dtype != torch.float32 or not zero_corr.is_contiguous()):
            raise ValueError(f"zero_corr must be contiguous fp32 {tuple(scales.t().shape)} on an int4 weight, got "
                             f"{zero_corr.dtype} {tuple(zero_corr.shape)} on {method}")
        self.zero_corr = zero_corr

    @classmethod
    def quantize(cls, weight: torch.Tensor, method: str, group: int = INT4_GROUP) -> QuantizedWeight:
        if method in ("int8", "w8a8"):
            q, s = quantize_int8(weight)
            return cls(method, q, s, tuple(weight.shape), weight.dtype)
        if method == "int4":
            q, s = quantize_int4(weight, group)
            return cls("int4", q, s, tuple(weight.shape), weight.dtype, group)
        if method == "w4a8":
            q, s = quantize_int4(weight, group, W4A8_STEP)
            return cls("w4a8", block_rows(q), s, tuple(weight.shape), weight.dtype, group)
        raise ValueError(f"quantization={method!r} is not supported; choose one of {', '.join(QUANTIZATION_METHODS)}")

    @property
    def nbytes(self) -> int:
        corr = 0 if self.zero_corr is None else self.zero_corr.numel() * 4
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 4 + corr

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def dequantize(self) -> torch.Tensor:
        """W as a plain fp32 ``[N, K]`` matrix."""
        if self.method in ("int8", "w8a8"):
            return self.qweight.float() * self.scales[:, None]
        return dequantize_int4(self.int4_rows(), self.scales, self.group, self.shape[1], self.zero_corr)

    def int4_rows(self) -> torch.Tensor:
        """int4 / w4a8: the packed weight in int4's row layout, uint8 [N, Kp / 2]."""
        return unblock_rows(self.qweight, self.shape[0]) if self.method == "w4a8" else self.qweight

    def to_dense(self) -> torch.Tensor:
        return self.dequantize().to(self.dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.method == "w4a8":
            return self._matmul_w4a8(x, bias)
        n, k = self.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        ops = cpu_ops.ops_for(x2, self.qweight)
        if self.method == "w8a8":
            return self._matmul_w8a8(ops, x2, bias).to(x.dtype).reshape(*lead, n)
        if ops is None:
            y = F.linear(x2.float(), self.dequantize(), None if bias is None else bias.float())
            return y.to(x.dtype).reshape(*lead, n)
        xf = x2.float().contiguous()
        if self.method == "int4" and xf.shape[1] != self.qweight.shape[1] * 2:
            xf = F.pad(xf, (0, self.qweight.shape[1] * 2 - k))
        b = None if bias is None else bias.float().contiguous()
        if xf.shape[0] >= LOWBIT_DEQUANT_ROWS[self.method]:
            y = decoded_matmul(xf, n, self._decoder(ops))
            if b is not None:
                y += b
        else:
            y = torch.empty(xf.shape[0], n, dtype=torch.float32)
            if self.method == "int8":
                ops.int8_linear(y, xf, self.qweight, self.scales, b)
            else:
                ops.int4_linear(y, xf, self.qweight, self.scales, self.group, b)
        if self.zero_corr is not None:
            groups = self.zero_corr.shape[0]
            if xf.shape[1] != groups * self.group:
                xf = F.pad(xf, (0, groups * self.group - xf.shape[1]))
            y.addmm_(xf.view(xf.shape[0], groups, self.group).sum(dim=2), self.zero_corr)
        return y.to(x.dtype).reshape(*lead, n)

    def _padded_kernel_matmul(self, x: torch.Tensor, bias: torch.Tensor | None, kp: int, run) -> torch.Tensor:
        """x W^T + bias for the formats whose kernel takes x zero-padded to the packed width ``kp`` and adds no bias
        (FP8, MXFP4): ``run(ops, xf)`` -> fp32 [M, N] on x widened to fp32 and padded; the torch reference
        (dequantise, fp32 matmul) where the kernels are off."""
        n, k = self.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        ops = cpu_ops.ops_for(x2, self.qweight)
        if ops is None:
            y = F.linear(x2.float(), self.dequantize(), None if bias is None else bias.float())
            return y.to(x.dtype).reshape(*lead, n)
        xf = x2.float().contiguous()
        if kp != k:
            xf = F.pad(xf, (0, kp - k))
        y = run(ops, xf)
        if bias is not None:
            y += bias.float()
        return y.to(x.dtype).reshape(*lead, n)

    def _decoder(self, ops):
        """``decode(out, n0, n1)`` for ``decoded_matmul``: rows n0:n1 of this matrix, fp32, by the kernel (the
        values of ``dequantize``, int4 without the zero-point correction, which matmul adds itself)."""
        if self.method == "int8":
            return lambda out, n0, n1: ops.int8_dequantize(out, self.qweight[n0:n1], self.scales[n0:n1])
        return lambda out, n0, n1: ops.int4_dequantize(out, self.qweight[n0:n1], self.scales[n0:n1], self.group)

    def _matmul_w8a8(self, ops, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """fp32 [M, N]: the kernel quantises x per token and runs int8 dot products; the reference does the same
        in torch (int32 matmul), so the two agree to the last bit."""
        xf = x.float().contiguous()
        b = None if bias is None else bias.float().contiguous()
        if ops is not None:
            y = torch.empty(xf.shape[0], self.shape[0], dtype=torch.float32)
            ops.w8a8_linear(y, xf, self.qweight, self.scales, b)
            return y
        return w8a8_reference(xf, self.qweight, self.scales, b)

    def _matmul_w4a8(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The kernel at every M (prefill too: its integer dot products outrun a decoded fp32 GEMM here, and one path
        keeps prefill and decode on the same numbers); the torch reference quantises x to the same integers and
        forms the same exact int32 group sums, differing only in the fp32 summation over groups. Each step skipped
        when it is a no-op: at batch 1 this Python is ~10 % of a call."""
        n, k = self.shape
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        xf = x2 if x2.dtype == torch.float32 else x2.float()
        kp = self.qweight.shape[1] * 2
        if kp != k:
            xf = F.pad(xf, (0, kp - k))
        if not xf.is_contiguous():
            xf = xf.contiguous()
        b = None if bias is None else bias.float().contiguous()
        ops = cpu_ops.ops_for(xf, self.qweight)
        if ops is not None:
            y = torch.empty(xf.shape[0], n, dtype=torch.float32)
            ops.w4a8_linear(y, xf, self.qweight, self.scales, self.group, b)
        else:
            y = w4a8_reference(xf, self.int4_rows(), self.scales, self.group, b)
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)

    @classmethod
    def cat(cls, parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row-wise concatenation (the fused q/k/v or gate/up projection from its checkpoint parts)."""
        first = parts[0]
        for p in parts[1:]:
            if (p.method, p.group, p.shape[1], p.qweight.shape[1:], p.dtype) != \
                    (first.method, first.group, first.shape[1], first.qweight.shape[1:], first.dtype):
                raise ValueError(f"cannot fuse quantised parts of different layouts: {first.method}/{first.group}/"
                                 f"{tuple(first.shape)} and {p.method}/{p.group}/{tuple(p.shape)}")
        if len(parts) == 1:
            return first
        n = sum(p.shape[0] for p in parts)
        if first.method == "w4a8":  # blocks of 4 rows do not concatenate: back to rows, and blocked again
            q = block_rows(torch.cat([p.int4_rows() for p in parts]))
            return cls("w4a8", q, torch.cat([p.scales for p in parts]).contiguous(), (n, first.shape[1]),
                       first.dtype, first.group)
        corr = None
        if any(p.zero_corr is not None for p in parts):  # a symmetric part's correction is zero (z = 8)
            corr = torch.cat([torch.zeros_like(p.scales.t()) if p.zero_corr is None else p.zero_corr for p in parts],
                             dim=1)
        return cls(first.method, torch.cat([p.qweight for p in parts]).contiguous(),
                   torch.cat([p.scales for p in parts]).contiguous(), (n, first.shape[1]), first.dtype, first.group,
                   None if corr is None else corr.contiguous())


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [M, K] -> (int8 [M, K] in [-127, 127], fp32 scales [M]): symmetric, per token (row). The kernel does
    the same arithmetic (x / s rounded half to even), so both give the same integers."""
    s = _safe_scale(x.abs().amax(dim=1), 127.0)
    return torch.round(x / s[:, None]).clamp(-127, 127).to(torch.int8), s


def w8a8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The torch W8A8 path: int8 x int8 dot products accumulated exactly in int32, then (dot * s_m) * s_n (+ bias)
    in fp32, in the kernel's order. ``torch._int_mm`` where the device has it (CUDA), else an int32 matmul."""
    xq, xs = quantize_activations(x)
    if x.is_cuda and xq.shape[0] > 16 and xq.shape[1] % 8 == 0 and qweight.shape[0] % 8 == 0:
        dot = torch._int_mm(xq, qweight.t())
    else:
        dot = xq.to(torch.int32) @ qweight.to(torch.int32).t()
    y = dot.float() * xs[:, None] * scales[None, :]
    return y if bias is None else y + bias


def block_rows(q: torch.Tensor) -> torch.Tensor:
    """int4 rows uint8 [N, Kp / 2] (Kp a multiple of 64) -> w4a8's blocks [ceil(N / 4) * 4, Kp / 2]: per block of 4
    rows, for each 64 columns the 4 rows' 32 bytes in turn; rows past N hold nibble 8 (q = 0)."""
    n, half = q.shape
    nb = -(-n // W4A8_ROWS)
    full = torch.full((nb * W4A8_ROWS, half), 0x88, dtype=torch.uint8)
    full[:n] = q
    steps = half // (W4A8_STEP // 2)
    return full.view(nb, W4A8_ROWS, steps, W4A8_STEP // 2).transpose(1, 2).reshape(nb * W4A8_ROWS, half).contiguous()


def unblock_rows(q: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of ``block_rows``: uint8 [n, Kp / 2]."""
    rows, half = q.shape
    steps = half // (W4A8_STEP // 2)
    return q.view(rows // W4A8_ROWS, steps, W4A8_ROWS, W4A8_STEP // 2).transpose(1, 2).reshape(rows, half)[:n]


def w4a8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The torch W4A8 path on x fp32 [M, Kp] (padded to the packed width): x quantised per token as in w8a8, each
    group's int4 x int8 dot product exact in int32, then s_m * sum_g s_ng dot_g (+ bias) in fp32."""
    xq, xs = quantize_activations(x)
    n, kp = qweight.shape[0], qweight.shape[1] * 2
    groups = scales.shape[1]
    b = qweight.view(n, kp // _INT4_RUN, _INT4_RUN // 2).to(torch.int32)
    wq = torch.stack([b & 0xF, b >> 4], dim=2).view(n, kp) - 8
    pad = groups * group - kp  # a last group shorter than ``group``
    xg = F.pad(xq.to(torch.int32), (0, pad)).view(-1, groups, group).transpose(0, 1)  # [G, M, group]
    wg = F.pad(wq, (0, pad)).view(n, groups, group).permute(1, 2, 0)  # [G, group, N]
    dot = torch.bmm(xg, wg)  # [G, M, N], exact
    y = (dot.float() * scales.t()[:, None, :]).sum(dim=0) * xs[:, None]
    return y if bias is None else y + bias


def _safe_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    s = amax / qmax
    return torch.where(s > 0, s, torch.ones_like(s))  # all-zero rows: any finite scale gives q = 0


@torch.no_grad()
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], fp32 scales [N])."""
    w = weight.float()
    s = _safe_scale(w.abs().amax(dim=1), 127.0)
    q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), s.contiguous()


@torch.no_grad()
def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP,
                  pad: int = _INT4_RUN) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (uint8 [N, Kp / 2] in the kernel's nibble order, fp32 scales [N, ceil(Kp / group)]); Kp is K
    rounded up to ``pad`` (16, or w4a8's 64), the extra columns zero."""
    if pad % _INT4_RUN or group <= 0 or group % pad:
        raise ValueError(f"int4 group size must be a positive multiple of {pad}, got {group}")
    n, k = weight.shape
    kp = -(-k // pad) * pad
    groups = -(-kp // group)
    w = torch.zeros(n, groups * group, dtype=torch.float32)
    w[:, :k] = weight.float()
    wg = w.view(n, groups, group)
    s = _safe_scale(wg.abs().amax(dim=2), 7.0)
    q = torch.round(wg / s[..., None]).clamp(-7, 7).view(n, -1)[:, :kp].to(torch.int16) + 8
    runs = q.view(n, kp // _INT4_RUN, 2, _INT4_RUN // 2)
    packed = (runs[:, :, 0] | (runs[:, :, 1] << 4)).to(torch.uint8).reshape(n, kp // 2)
    return packed.contiguous(), s.contiguous()


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, group: int, k: int,
                    zero_corr: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of ``quantize_int4`` (up to rounding): fp32 [N, k]; with ``zero_corr`` [G, N] (asymmetric),
    (q - 8) s + s (8 - z) = (q - z) s."""
    n, kp = packed.shape[0], packed.shape[1] * 2
    b = packed.view(n, kp // _INT4_RUN, _INT4_RUN // 2).to(torch.int16)
    q = torch.stack([b & 0xF, b >> 4], dim=2).view(n, kp).float() - 8.0
    w = q * scales.repeat_interleave(group, dim=1)[:, :kp]
    if zero_corr is not None:
        w += zero_corr.t().repeat_interleave(group, dim=1)[:, :kp]
    return w[:, :k]
