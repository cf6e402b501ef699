"""GGUF block-quantized linear weights kept in the file's block format and executed packed (issue 40).

``GGUFWeight`` holds one ``[N, K]`` weight as the raw bytes of its rows, exactly as a GGUF file stores them (uint8
``[N, K / block * type_size]``, ``gguf.GGML_QUANT_SIZES``), for the types the common Q4_K_M / Q5_K_M / Q6_K / Q8_0
files and SmolLM2's Q4_1 hold: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K. It offers ``Linear`` what
``QuantizedWeight`` does (``Linear.load_quantized`` takes it as it is): ``matmul``, ``to_dense``, ``nbytes``, ``cat``.

``matmul`` runs ``cpu_kernels/gguf_q8_gemm.cpp`` on the CPU where the kernel selection says int8
(``KernelSelection.gguf_int8``: the default where the build has VNNI or AVX2): x quantised to int8 per row and
32 columns, integer dot products with the blocks' integers, as llama.cpp computes (``matmul_q8_reference`` below is
its arithmetic in torch). Otherwise ``cpu_kernels/gguf_gemm.cpp``: the blocks decoded in registers, fp32 activations,
fp32 accumulation, so the result is dequantise-then-matmul up to fp32 summation order. From ``GGUF_TILE_ROWS``
activation rows on (prefill) with int8 activations, ``cpu_kernels/gguf_q8_tiles.cpp``: the same int8 arithmetic
(``matmul_q8_reference``), each 16 weight rows decoded once into an int8 tile for integer dots over every row. From
``GGUF_DEQUANT_ROWS`` rows on otherwise (fp32 activations, the logits head, a type or build without a tile kernel)
row chunks are decoded to fp32 by the kernel and multiplied by torch's GEMM (``quant_linear.decoded_matmul``).
Where the kernels are off (torch backend, no compiler, a GPU tensor) the torch
reference below decodes the blocks with torch ops (any device) and multiplies in fp32. Both decoders give
``gguf.quants.dequantize``'s values to the bit: every format's w = q * s + o has an exact product q * s (an fp16
scale's 11 significant bits times a 6-bit sub-block scale and a 5-bit integer at most: 22 bits), so one rounding
happens, the one gguf's numpy makes (Q6_K, whose d * sc * q can need 25 bits, rounds that product once, as gguf's
(d * sc) * q does).

Not reused: the int4 kernel (``lowbit_gemm.cpp``) would take Q4_0 after moving nibbles at load, but it needs fp32
group scales (4 bytes per 32 weights next to Q4_0's 2) and a copy of the matrix in its own layout; Q4_1 needs a
zero-point correction matmul per call on top; and it measured slower at batch 1 and 8 (``scripts/gguf_gemm_speed.py
--compare-int4``, 1 thread, loaded host, 576 x 1536 / 1536 x 576 / 49152 x 576 / 4096 x 4096: M = 1 2.3 / 2.5 /
2.8 / 2.4 GB/s of weight against Q4_0's 2.8 / 3.4 / 3.2 / 3.3, M = 8 1.2-2.3x Q4_0's time; docs/gguf_kernels.md).
From 24 rows both decode row chunks to fp32 for a GEMM; ``gguf_dequantize`` decodes Q4_0 in 0.13 ms per 512 x 4096
rows against int4_dequantize's 0.27 (1 thread). One kernel reading the file's bytes serves every type.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from openinfer.layers import cpu_ops, dispatch
from openinfer.layers.quant_linear import decoded_matmul

GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# From this many activation rows on, decode row chunks to fp32 and run torch's GEMM (the register tile re-decodes
# every block for each 4 activation rows). ``scripts/gguf_gemm_speed.py --threads 1 --m 16 24 --crossover`` (1 thread,
# 2-core AVX-512 EPYC shared with other jobs, load ~10, so +-30 %), ms kernel / decoded + GEMM at M = 24:
# 576 x 1536 Q8_0 2.56 / 2.07, Q4_K 2.97 / 2.49, Q6_K 1.82 / 1.65, Q4_1 2.67 / 3.56; 1536 x 576 Q4_1 1.45 / 1.04,
# Q8_0 1.89 / 1.18; 4096 x 4096 Q4_K 41.7 / 37.3, Q6_K 40.2 / 33.8, Q4_1 22.3 / 39.9; at M = 16 even within noise.
GGUF_DEQUANT_ROWS = 24
# With int8 activations, from this many rows on the tile kernel (``cpu_kernels/gguf_q8_tiles.cpp``: each chunk of 16
# weight rows decoded once into an int8 tile, integer dots over every activation row) instead of either path above,
# for the types it has (``gguf_q8_tiled_supports``; the others keep the paths above). Kept equal to GGUF_DEQUANT_ROWS
# (the fused decode block runs the small-M kernel below it, and must give this path's bits). /tmp bench of the three
# GGUF sources built alone (docs/gguf_kernels.md, "Int8 prefill"), 1 thread, min of 3 alternating, host at load ~17
# on 2 CPUs at idle priority (single cells off by up to 5x): ms tiles / decode + GEMM / small-M int8 at M = 24:
# 576 x 1536 Q8_0 9.05 / 15.9 / 9.62, Q4_K 4.78 / 18.0 / 9.49, Q6_K 10.7 / 15.9 / 11.9; 1536 x 576 Q4_1 7.91 / 15.5
# / 13.2, Q8_0 9.36 / 8.61 / 10.8; 4096 x 4096 Q4_1 143 / 368 / 168, Q8_0 101 / 180 / 125. Tiles were ahead of
# decode + GEMM in 26 of 32 cells at M = 24..1024; re-measure on a quiet host before moving the threshold.
GGUF_TILE_ROWS = GGUF_DEQUANT_ROWS
# Types ``GGUFWeight.repacked`` interleaves 8 rows at a time at load (``cpu_kernels/gguf_repack.cpp``), and the
# offset of a repacked weight's type code over the file's (the kernels tell the layouts apart by it).
REPACK_TYPES = ("Q4_K", "Q6_K")
REPACK_CODE_OFFSET = 1000


_TILED: dict[int, bool] = {}  # type code -> whether the loaded kernel build has its tile kernel


def _tiled(ops, code: int) -> bool:
    """Whether the kernel build has the tile kernel for the type (asked once per type)."""
    if code not in _TILED:
        _TILED[code] = bool(ops.gguf_q8_tiled_supports(code))
    return _TILED[code]


@functools.cache
def type_info(qtype: str) -> tuple[int, int, int]:
    """(GGMLQuantizationType value, weights per block, bytes per block) of a supported type name."""
    if qtype not in GGUF_TYPES:
        raise ValueError(f"GGUF tensor type {qtype!r} is not supported packed; supported: {', '.join(GGUF_TYPES)}")
    import gguf  # llama.cpp's reader; imported when a GGUF weight is made (it costs ~0.2 s)

    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    return int(t.value), block, size


class GGUFWeight:
    """One linear weight ``[N, K]`` in a GGUF block format; ``matmul(x, bias)`` = x W^T + bias in x's dtype."""

    method = "gguf"

    def __init__(self, qtype: str, data: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> None:
        code, block, size = type_info(qtype)
        n, k = (int(s) for s in shape)
        row_bytes = k // block * size
        if n <= 0 or k <= 0 or k % block:
            raise ValueError(f"GGUF {qtype} weight of shape ({n}, {k}): K must be a positive multiple of the "
                             f"block size {block}")
        if data.dtype != torch.uint8 or data.dim() != 2 or tuple(data.shape) != (n, row_bytes):
            raise ValueError(f"GGUF {qtype} weight of shape ({n}, {k}) needs uint8 data [{n}, {row_bytes}] "
                             f"({row_bytes} bytes per row: {k // block} blocks of {size}), got {data.dtype} "
                             f"{tuple(data.shape)}")
        self.qtype = qtype
        self.code = code
        self.block = block
        self.data = data.contiguous()
        self.shape = torch.Size((n, k))
        self.dtype = dtype  # what the dense weight comes back as (Linear.load_quantized sets the model's)
        self.layout = "file"  # or "r8": ``repacked``

    def repacked(self) -> GGUFWeight:
        """This weight with its rows interleaved 8 at a time (``cpu_kernels/gguf_repack.cpp``: one pass over the
        weights serves every activation row, scales decoded once per 8 rows), replacing the file's bytes, where
        every GGUF linear runs int8 activations (``KernelSelection.gguf_int8_everywhere``: decode, prefill and head
        all take the repacked kernel) and the type has the layout (Q4_K, Q6_K); else self. The file's bytes are
        not kept: a dense view or an fp32-activation call unpacks them for that call (exact byte moves)."""
        ops = cpu_ops.ops_for(self.data)
        if (self.layout != "file" or self.qtype not in REPACK_TYPES or ops is None
                or not dispatch.active().gguf_int8_everywhere):
            return self
        out = GGUFWeight.__new__(GGUFWeight)
        out.__dict__.update(self.__dict__)
        out.data = ops.gguf_repack8(self.data, self.code)  # rows padded to a multiple of 8 with zero rows
        out.code = self.code + REPACK_CODE_OFFSET
        out.layout = "r8"
        return out

    def file_data(self) -> torch.Tensor:
        """The rows' bytes in the file's layout (unpacked for this call where the weight is repacked)."""
        if self.layout == "file":
            return self.data
        return cpu_ops.ops_for(self.data).gguf_unpack8(self.data, self.code, self.shape[0])

    @property
    def file_code(self) -> int:
        return self.code - REPACK_CODE_OFFSET if self.layout == "r8" else self.code

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def _decode_into(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        ops = cpu_ops.ops_for(rows, out)
        if ops is not None:
            ops.gguf_dequantize(out, rows, self.file_code)
        else:
            out.copy_(dequantize_reference(rows, self.qtype, self.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """W as fp32 ``[N, K]`` (gguf.quants.dequantize's values)."""
        return self.rows(None)

    def to_dense(self) -> torch.Tensor:
        return self.dequantize().to(self.dtype)

    def rows(self, index: torch.Tensor | None) -> torch.Tensor:
        """fp32 ``[len(index), K]``: only those rows dequantised (an embedding lookup on a quantized token table);
        every row for None."""
        data = self.file_data()
        data = data if index is None else data.index_select(0, index.to(data.device).reshape(-1))
        out = torch.empty(data.shape[0], self.shape[1], dtype=torch.float32, device=data.device)
        if data.shape[0]:
            self._decode_into(out, data)
        return out

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, fp32_activations: bool = False) -> torch.Tensor:
        """x W^T + bias; ``fp32_activations`` keeps x in fp32 where the selection would quantise it to int8 (the
        logits head: ``ParallelLMHead``)."""
        n, k = self.shape
        x2 = x.reshape(-1, k)
        ops = cpu_ops.ops_for(x2, self.data)
        if ops is None:  # the torch reference: decoded for this call, fp32 matmul
            y = F.linear(x2.float(), self.dequantize(), None if bias is None else bias.float())
            return y.to(x.dtype).reshape(*x.shape[:-1], n)
        xf = x2.float().contiguous()
        b = None if bias is None else bias.float().contiguous()
        sel = dispatch.active()
        int8 = not fp32_activations and sel.gguf_int8
        if self.layout == "r8":
            if not int8:  # fp32 activations asked of a repacked weight: the file's layout for this call
                return GGUFWeight(self.qtype, self.file_data(), self.shape, self.dtype).matmul(x, bias, True)
            y = torch.empty(xf.shape[0], n, dtype=torch.float32)
            ops.gguf_linear_q8(y, xf, self.data, self.code, b)  # the repacked kernel, every M
        elif int8 and sel.gguf_int8_everywhere and xf.shape[0] >= GGUF_TILE_ROWS and _tiled(ops, self.code):
            y = torch.empty(xf.shape[0], n, dtype=torch.float32)
            ops.gguf_linear_q8_tiled(y, xf, self.data, self.code, b)
        elif xf.shape[0] >= GGUF_DEQUANT_ROWS:
            y = decoded_matmul(xf, n, lambda out, n0, n1: ops.gguf_dequantize(out, self.data[n0:n1], self.code))
            if b is not None:
                y += b
        else:
            y = torch.empty(xf.shape[0], n, dtype=torch.float32)
            (ops.gguf_linear_q8 if int8 else ops.gguf_linear)(y, xf, self.data, self.code, b)
        return y.to(x.dtype).reshape(*x.shape[:-1], n)

    @classmethod
    def cat(cls, parts: list[GGUFWeight]) -> GGUFWeight | GGUFWeightParts:
        """Row-wise concatenation (fused q/k/v, gate/up): one weight when every part has the same type, else the
        parts kept side by side (Q4_K_M files mix Q4_K and Q6_K within a layer), each run by its own kernel."""
        k = parts[0].shape[1]
        if any(p.shape[1] != k for p in parts):
            raise ValueError(f"cannot fuse GGUF weights with different K: {[tuple(p.shape) for p in parts]}")
        if len(parts) == 1:
            return parts[0]
        n = sum(p.shape[0] for p in parts)
        if all(isinstance(p, GGUFWeight) and p.qtype == parts[0].qtype for p in parts):
            return cls(parts[0].qtype, torch.cat([p.file_data() for p in parts]), (n, k), parts[0].dtype)
        flat: list[GGUFWeight] = []
        for p in parts:
            flat += p.parts if isinstance(p, GGUFWeightParts) else [p]
        return GGUFWeightParts(flat, parts[0].dtype)


class GGUFWeightParts:
    """A fused weight whose row blocks have different GGUF types: ``matmul`` runs each block and concatenates the
    outputs (one extra copy of the [M, N] result per call)."""

    method = "gguf"

    def __init__(self, parts: list[GGUFWeight], dtype: torch.dtype) -> None:
        self.parts = parts
        self.shape = torch.Size((sum(p.shape[0] for p in parts), parts[0].shape[1]))
        self.dtype = dtype
        self.qtype = "+".join(p.qtype for p in parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def repacked(self) -> GGUFWeightParts:
        """Each part as ``GGUFWeight.repacked`` makes it."""
        parts = [p.repacked() for p in self.parts]
        if all(a is b for a, b in zip(parts, self.parts)):
            return self
        return GGUFWeightParts(parts, self.dtype)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def to_dense(self) -> torch.Tensor:
        return self.dequantize().to(self.dtype)

    def rows(self, index: torch.Tensor | None) -> torch.Tensor:
        if index is None:
            return self.dequantize()
        idx = index.reshape(-1).to(self.parts[0].data.device)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.shape[0]):
            raise ValueError(f"row index out of range for a GGUF weight of {self.shape[0]} rows")
        out = torch.empty(idx.numel(), self.shape[1], dtype=torch.float32, device=idx.device)
        start = 0
        for p in self.parts:  # each part decodes only the rows asked of it
            sel = (idx >= start) & (idx < start + p.shape[0])
            if sel.any():
                out[sel] = p.rows(idx[sel] - start)
            start += p.shape[0]
        return out

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, fp32_activations: bool = False) -> torch.Tensor:
        y = torch.cat([p.matmul(x, None, fp32_activations) for p in self.parts], dim=-1)
        return y if bias is None else y + bias.to(y.dtype)

    @classmethod
    def cat(cls, parts: list) -> GGUFWeight | GGUFWeightParts:
        return GGUFWeight.cat(parts)


# -- the torch reference decoders ----------------------------------------------------------------------------------

def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two little-endian bytes ([..., 2] uint8) as fp16's value in fp32, [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """[..., nbytes] uint8 -> [..., count] int32 of its bits, little-endian (bit i of byte i // 8)."""
    shifts = torch.arange(8, device=b.device, dtype=torch.int32)
    bits = (b.to(torch.int32)[..., :, None] >> shifts) & 1
    return bits.reshape(*b.shape[:-1], b.shape[-1] * 8)[..., :count]


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] int32: low nibbles are elements 0..15, high nibbles 16..31."""
    q = qs.to(torch.int32)
    return torch.cat([q & 0xF, q >> 4], dim=-1)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] -> the 8 six-bit scales and mins of a Q4_K / Q5_K super-block, int32 [..., 8] each."""
    s = s.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 0xF) | ((d >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc, mn


def decode_reference(data: torch.Tensor, qtype: str, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GGUF rows ``data`` (uint8 ``[N, row_bytes]``) taken apart in torch ops, on data's device: ``(q, s, o)`` with
    q int32 ``[N, blocks, groups, group size]`` (the integers, a _0 type's or Q6_K's offset taken off), s fp32
    ``[N, blocks, groups]`` the group scales, o the group mins in s's shape (None for the types without one); the
    weight is w = q * s + o per group."""
    _, block, size = type_info(qtype)
    n = data.shape[0]
    b = data.reshape(n, k // block, size)
    if qtype == "Q8_0":
        q, s, o = b[..., 2:].view(torch.int8).to(torch.int32)[..., None, :], _f16(b[..., 0:2])[..., None], None
    elif qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        has_min, five = qtype.endswith("_1"), qtype.startswith("Q5")
        p = 4 if has_min else 2
        q = _nibbles32(b[..., p + (4 if five else 0):])
        if five:
            q = q | (_bits(b[..., p:p + 4], 32) << 4)
        if not has_min:
            q = q - (16 if five else 8)
        q, s = q[..., None, :], _f16(b[..., 0:2])[..., None]
        o = _f16(b[..., 2:4])[..., None] if has_min else None
    elif qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, mn = _scale_min_k4(b[..., 4:16])
        qs = b[..., 16 + (32 if qtype == "Q5_K" else 0):].to(torch.int32).reshape(n, -1, 4, 32)
        q = torch.stack([qs & 0xF, qs >> 4], dim=-2).reshape(n, -1, 8, 32)  # sub-block 2c: low nibbles of run c
        if qtype == "Q5_K":
            qh = b[..., 16:48].to(torch.int32)[..., None, :]  # bit j of byte i: element i of sub-block j
            q = q | (((qh >> torch.arange(8, device=b.device, dtype=torch.int32)[:, None]) & 1) << 4)
        s, o = d * sc.float(), -(dmin * mn.float())
    elif qtype == "Q6_K":
        ql = b[..., 0:128].to(torch.int32).reshape(n, -1, 2, 1, 64)
        ql = torch.cat([ql & 0xF, ql >> 4], dim=-2).reshape(n, -1, 8, 32)
        qh = b[..., 128:192].to(torch.int32).reshape(n, -1, 2, 1, 32)
        qh = ((qh >> (2 * torch.arange(4, device=b.device, dtype=torch.int32))[:, None]) & 3).reshape(n, -1, 8, 32)
        q = ((ql | (qh << 4)) - 32).reshape(n, -1, 16, 16)
        s, o = _f16(b[..., 208:210])[..., None] * b[..., 192:208].view(torch.int8).float(), None
    else:
        raise ValueError(f"GGUF tensor type {qtype!r} has no reference decoder")
    return q.expand(*s.shape, q.shape[-1]), s, o


def dequantize_reference(data: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """fp32 ``[N, k]`` from GGUF rows ``data`` in torch ops, on data's device: w = q * s + o per group,
    gguf.quants.dequantize's values to the bit (the module docstring says why)."""
    q, s, o = decode_reference(data, qtype, k)
    w = q.float() * s[..., None]
    if o is not None:
        w = w + o[..., None]
    return w.reshape(data.shape[0], k)


def quantize_activations_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` (K a multiple of 32) as the int8 kernel quantises it, per row and 32-column block:
    ``(q int8 [M, K], d fp32 [M, K / 32])`` with d = max |x| / 127 and q = round_half_even(x * (1 / d)) (0 where
    a block is all zeros) -- the same fp32 operations as ``gguf_q8_gemm.cpp``, so the same integers."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(x.shape), d


def matmul_q8_reference(x: torch.Tensor, data: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """The int8 path's arithmetic in torch (both kernels: gguf_q8_gemm.cpp below GGUF_TILE_ROWS rows,
    gguf_q8_tiles.cpp from there; they differ only in the order of their fp32 sums), float64 ``[M, N]``: x
    quantised as ``quantize_activations_q8``, per group
    the exact integer dot of the weight's integers with x's, times the group scale and x's block scale, plus each
    group's min times the block's sum of the rounded x: y = Σ_g s_g d_x Σ q_w q_x + Σ_g o_g d_x Σ q_x, i.e. the
    dequantised W times the rounded x (as llama.cpp's q8_1 / q8_K sums do; the exact Σ x would leave the rounding
    error on the uncentred w - o, which cost SmolLM2 ~3x llama.cpp's perplexity loss). The kernel computes the same
    integers and rounds only its fp32 sums of these terms."""
    qx, dx = quantize_activations_q8(x)
    q, s, o = decode_reference(data, qtype, k)
    n, gs = q.shape[0], q.shape[-1]
    qw = q.reshape(n, -1, gs).to(torch.int64)  # [N, K / gs, gs]
    xg = qx.reshape(x.shape[0], -1, gs).to(torch.int64)  # [M, K / gs, gs]
    dots = torch.einsum("mgi,ngi->mng", xg, qw)  # exact
    per = 32 // gs  # scale groups per 32-column activation block
    dxg = dx.double().repeat_interleave(per, dim=1)  # [M, K / gs]
    y = (dots.double() * s.reshape(n, -1).double()[None] * dxg[:, None]).sum(-1)
    if o is not None:  # the min terms, with the rounded activations' sum per group (gs = 32 for every min type)
        xsum = qx.reshape(x.shape[0], -1, gs).to(torch.int64).sum(-1).double() * dx.double()
        y = y + xsum @ o.reshape(n, -1).double().T
    return y
