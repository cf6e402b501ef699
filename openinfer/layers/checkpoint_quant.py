"""Low-bit checkpoints as people publish them, turned into ``QuantizedWeight``\\ s without dequantising.

``quantization_config.checkpoint_quantization`` reads the format from config.json; ``QuantizedTensorGrouper.convert`` gathers
each linear's tensors (which may arrive in any order, from any shard) and yields one ``(X.weight, QuantizedWeight)``
per linear, repacked once into the kernels' layout (``quant_linear.py``); every other tensor passes through as is.

- compressed-tensors ``int-quantized`` / ``naive-quantized`` (W8A8): ``X.weight`` int8 [N, K] is kept as is with
  ``X.weight_scale`` [N, 1] as fp32 [N] -> method ``w8a8``. A ``X.weight_zero_point`` must be all zero (symmetric).
- compressed-tensors ``pack-quantized`` (W4A16): ``X.weight_packed`` int32 [N, ceil(K / 8)] holds q + 8 in nibbles,
  column 8 j + i at bits 4 i of word j; ``X.weight_shape`` [2] = (N, K); ``X.weight_scale`` [N, ceil(K / group)].
- GPTQ (v1 checkpoint format, no desc_act): ``X.qweight`` int32 [K / 8, N], the nibble of input row 8 j + i at
  bits 4 i of row j; ``X.qzeros`` int32 [G, N / 8] (zero - 1 per nibble, so 7 for symmetric 4-bit, whose zero is
  8; the + 1 is applied after unpacking, so a stored 15 reads as 16); ``X.scales`` [G, N]; ``X.g_idx`` [K] (must
  be k // group: no activation order). ``sym: false`` checkpoints hold other zeros.
- AWQ (AutoAWQ's ``gemm`` version): ``X.qweight`` int32 [K, N / 8], packed along N: word j of a row holds
  columns 8 j .. 8 j + 7 with column 8 j + AWQ_ORDER[i] at bits 4 i; ``X.qzeros`` int32 [G, N / 8] the same way
  (the zero itself, no offset); ``X.scales`` fp16 [G, N]; w = (q - z) * s.
All int4 forms dequantise as (nibble - zero) * scale; the int4 kernel's arithmetic is (nibble - 8) * scale, so the
nibbles are only moved, never changed, and a zero other than 8 becomes ``QuantizedWeight.zero_corr``, s (8 - z)
(quant_linear.py says how it is applied). Scales are widened to fp32 (exact from bf16 / fp16).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from openinfer.quantization_config import CheckpointQuantization
from openinfer.layers.quant_linear import QuantizedWeight
from openinfer.layers.weight_utils import WeightLoadError, materialize

_RUN = 16  # columns per packed run of the int4 kernel's layout

# AutoAWQ's nibble order inside each int32 of qweight / qzeros: nibble i (bits 4 i) holds column 8 j + AWQ_ORDER[i]
# (AutoAWQ awq/modules/linear/gemm.py WQLinear_GEMM.from_linear ``order_map = [0, 2, 4, 6, 1, 3, 5, 7]``;
# awq/utils/packing_utils.py AWQ_ORDER / AWQ_REVERSE_ORDER; vLLM's awq_triton.py reads it the same way).
# AWQ_REVERSE_ORDER[c] is the nibble that holds column 8 j + c.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)

# The tensors that make up one quantised linear in each format (the first is the one that says "this is it").
_PARTS = {
    "w8a8": ("weight", "weight_scale"),
    "pack-quantized": ("weight_packed", "weight_scale", "weight_shape"),
    "gptq": ("qweight", "qzeros", "scales"),
    "awq": ("qweight", "qzeros", "scales"),
}
_OPTIONAL = {"w8a8": ("weight_zero_point",), "pack-quantized": ("weight_zero_point",), "gptq": ("g_idx",),
             "awq": ()}


def _layout(cq: CheckpointQuantization) -> str:
    if cq.quant_method in ("gptq", "awq"):
        return cq.quant_method
    return "pack-quantized" if cq.method == "int4" else "w8a8"


def unpack_int32_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> uint8 nibbles (0..15), 8 per word along ``dim``, nibble i of a word at bits 4 i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    p = packed.to(torch.int32)
    if dim == 1:
        nib = (p[:, :, None] >> shifts) & 0xF  # [R, W, 8]
        return nib.reshape(p.shape[0], -1).to(torch.uint8)
    nib = (p[:, None, :] >> shifts[None, :, None]) & 0xF  # [W, 8, C]
    return nib.reshape(-1, p.shape[1]).to(torch.uint8)


def unpack_awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, C / 8] (qweight or qzeros) -> uint8 [R, C] nibbles with the columns in order."""
    nib = unpack_int32_nibbles(packed, 1)  # column 8 j + i holds nibble i of word j
    r, c = nib.shape
    return nib.view(r, c // 8, 8)[:, :, list(AWQ_REVERSE_ORDER)].reshape(r, c)


def pack_kernel_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] nibbles (q + 8) -> the int4 kernel's layout uint8 [N, Kp / 2] (Kp = K rounded up to 16, padded
    with q = 0): in each run of 16 columns, byte i = column i | column i + 8 << 4."""
    n, k = nibbles.shape
    kp = -(-k // _RUN) * _RUN
    full = torch.full((n, kp), 8, dtype=torch.int16)
    full[:, :k] = nibbles.to(torch.int16)
    runs = full.view(n, kp // _RUN, 2, _RUN // 2)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).to(torch.uint8).reshape(n, kp // 2).contiguous()


class QuantizedTensorGrouper:
    """Feed every checkpoint tensor through ``feed``; call ``finish`` at the end (raises for incomplete linears)."""

    def __init__(self, cq: CheckpointQuantization, dtype: torch.dtype) -> None:
        self.cq = cq
        self.layout = _layout(cq)
        self.dtype = dtype  # the model dtype: what the dense weight would have been
        self.parts = _PARTS[self.layout]
        self.suffixes = self.parts + _OPTIONAL[self.layout]
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def convert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
        """Plain tensors pass through at once; the quantised linears come at the end, once every shard has been
        read (a linear's tensors, optional ones included, may sit in different shards in any order). Holding them
        costs nothing extra: they are what stays resident."""
        for name, tensor in weights:
            split = self._split(name, tensor)
            if split is None:
                yield name, tensor
            else:
                self.pending.setdefault(split[0], {})[split[1]] = materialize(tensor)
        for prefix in sorted(self.pending):
            group = self.pending[prefix]
            missing = [p for p in self.parts if p not in group]
            if missing:
                raise WeightLoadError(f"quantised linear {prefix!r} ({self.cq.quant_method} {self.cq.format}) is "
                                      f"missing {', '.join(prefix + '.' + m for m in missing)}")
            yield prefix + ".weight", self._build(prefix, group)
        self.pending.clear()

    def _split(self, name: str, tensor) -> tuple[str, str] | None:
        prefix, _, suffix = name.rpartition(".")
        if suffix not in self.suffixes:
            return None
        if self.layout == "w8a8" and suffix == "weight" and tensor.dtype != torch.int8:
            return None  # a dense weight (an ignored module such as lm_head, or an embedding or norm)
        return prefix, suffix

    # -- per format ------------------------------------------------------------------------------------------
    def _build(self, prefix: str, t: dict[str, torch.Tensor]) -> QuantizedWeight:
        try:
            if self.layout == "w8a8":
                return self._w8a8(t)
            if self.layout == "pack-quantized":
                return self._pack_quantized(t)
            if self.layout == "awq":
                return self._awq(t)
            return self._gptq(t)
        except (ValueError, RuntimeError) as e:
            raise WeightLoadError(f"quantised linear {prefix!r} ({self.cq.quant_method} {self.cq.format}): {e}") \
                from None

    @staticmethod
    def _no_zero_point(t: dict[str, torch.Tensor]) -> None:
        zp = t.get("weight_zero_point")
        if zp is not None and bool((zp != 0).any()):
            raise ValueError("weight_zero_point is not all zero (asymmetric weights are not supported)")

    def _w8a8(self, t: dict[str, torch.Tensor]) -> QuantizedWeight:
        q = t["weight"]
        if q.dim() != 2:
            raise ValueError(f"weight must be int8 [N, K], got shape {tuple(q.shape)}")
        n, k = q.shape
        s = t["weight_scale"].float().reshape(-1)
        if s.numel() != n:
            raise ValueError(f"weight_scale has {s.numel()} values, one per output channel ({n}) is expected")
        self._no_zero_point(t)
        return QuantizedWeight("w8a8", q.contiguous(), s.contiguous(), (n, k), self.dtype)

    def _int4(self, nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None) -> QuantizedWeight:
        """nibbles [N, K], scales [N, G], zeros (None: 8) [N, G] -> w = (nibble - zero) * scale."""
        n, k = nibbles.shape
        g = self.cq.group
        if scales.shape != (n, -(-k // g)):
            raise ValueError(f"scales have shape {tuple(scales.shape)}, ({n}, {-(-k // g)}) is expected for "
                             f"[N={n}, K={k}] in groups of {g}")
        s = scales.float().contiguous()
        corr = None
        if zeros is not None and bool((zeros != 8).any()):
            corr = (s * (8 - zeros.float())).t().contiguous()  # exact: a small integer times an fp16 / bf16 scale
        return QuantizedWeight("int4", pack_kernel_int4(nibbles), s, (n, k), self.dtype, g, corr)

    def _pack_quantized(self, t: dict[str, torch.Tensor]) -> QuantizedWeight:
        shape = t["weight_shape"].reshape(-1).tolist()
        if len(shape) != 2:
            raise ValueError(f"weight_shape must hold (N, K), got {shape}")
        n, k = int(shape[0]), int(shape[1])
        packed = t["weight_packed"]
        if packed.dtype != torch.int32 or tuple(packed.shape) != (n, -(-k // 8)):
            raise ValueError(f"weight_packed must be int32 ({n}, {-(-k // 8)}), got {packed.dtype} "
                             f"{tuple(packed.shape)}")
        self._no_zero_point(t)
        return self._int4(unpack_int32_nibbles(packed, 1)[:, :k], t["weight_scale"])

    def _gptq(self, t: dict[str, torch.Tensor]) -> QuantizedWeight:
        qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
        if qweight.dtype != torch.int32 or qweight.dim() != 2:
            raise ValueError(f"qweight must be int32 [K / 8, N], got {qweight.dtype} {tuple(qweight.shape)}")
        k, n = qweight.shape[0] * 8, qweight.shape[1]
        g = self.cq.group
        groups = -(-k // g)
        if tuple(qzeros.shape) != (groups, -(-n // 8)):
            raise ValueError(f"qzeros has shape {tuple(qzeros.shape)}, ({groups}, {-(-n // 8)}) is expected")
        zeros = unpack_int32_nibbles(qzeros, 1)[:, :n].to(torch.int16) + 1  # v1 stores zero - 1
        if self.cq.symmetric and bool((zeros != 8).any()):
            raise ValueError("qzeros are not all 8 (zero - 1 = 7) but quantization_config.sym is true: "
                             "asymmetric weights in a symmetric checkpoint")
        g_idx = t.get("g_idx")
        if g_idx is not None and not torch.equal(g_idx.long().reshape(-1), torch.arange(k) // g):
            raise ValueError("g_idx is not k // group_size (activation order): not supported")
        nibbles = unpack_int32_nibbles(qweight, 0).t().contiguous()  # [N, K]
        return self._int4(nibbles, scales.t(), zeros.t())

    def _awq(self, t: dict[str, torch.Tensor]) -> QuantizedWeight:
        qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
        if qweight.dtype != torch.int32 or qweight.dim() != 2:
            raise ValueError(f"qweight must be int32 [K, N / 8], got {qweight.dtype} {tuple(qweight.shape)}")
        k, n = qweight.shape[0], qweight.shape[1] * 8
        g = self.cq.group
        if k % g:
            raise ValueError(f"quantization_config.group_size={g} does not divide the input size K={k}")
        if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (k // g, n // 8):
            raise ValueError(f"qzeros must be int32 ({k // g}, {n // 8}), got {qzeros.dtype} {tuple(qzeros.shape)}")
        if scales.dim() != 2 or not scales.is_floating_point():
            raise ValueError(f"scales must be float [K / group, N], got {scales.dtype} {tuple(scales.shape)}")
        nibbles = unpack_awq_columns(qweight).t().contiguous()  # [N, K]
        zeros = unpack_awq_columns(qzeros).t().to(torch.int16)  # [N, G]
        return self._int4(nibbles, scales.t(), zeros)
