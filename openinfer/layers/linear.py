"""``nn.Linear`` with CPU fast paths: weights prepacked once into a blocked layout, else wide outputs computed in row
blocks.

Why prepacking: torch's CPU ``F.linear`` calls MKL sgemm on a plain row-major weight, which on this project's
AVX2 host (AMD EPYC, torch 2.13, fp32) is poor for the small-M shapes decoding produces. Two blocked layouts:
- fp32 (with the C++ kernels built): our 16-column panels (``cpu_ops.pack_panels``, ``cpu_kernels/panel_gemm.cpp``
  says why and how), one contiguous stream per call whatever M. Against oneDNN's ``_linear_pointwise`` on its own
  prepacked layout (1 thread, Zen 3, weights streamed from memory, GFLOP/s): M = 1 10-11 vs 6-9, M = 8 45 vs
  34-38, M = 16 60-68 vs 42-53, M = 32 73-79 vs 60-65, M = 512-2048 84-96 vs 69-85; the DeepSeek-V3 bench model's
  fp32 decode step (MLA's absorbed W_UK / W_UV on panels too) 1.08 / 1.14 / 1.12x faster at batch 1 / 8 / 32
  (``scripts/profile_decode_step.py``, ``OPENINFER_CPU_PANELS=1`` vs ``0``, 3 interleaved rounds).
- native bf16 (AVX-512 BF16 / AMX), or fp32 with ``OPENINFER_CPU_PANELS=0`` or no kernels: oneDNN's blocked
  layout (``_reorder_linear_weight``; one copy serves every M). Before the panels it was the fp32 path too, measured
  (1 thread, min-of-15 medians, the Llama bench model's shapes summed over 16 layers + lm_head, ``F.linear`` /
  512-row split / prepacked, ms):

| M (tokens in the step) | 1    | 8     | 32    | 64    |
| total                  | 33.6 / 34.0 / 36.9 | 101.8 / 79.3 / 48.3 | 142.1 / 143.0 / 103.7 | 219.2 / 224.4 / 175.1 |

and within +-5% of ``F.linear`` for prefill-sized M (256-1024). Either layout differs from ``F.linear`` only by
summation order (fp32 max abs diff ~1e-4 on outputs of magnitude ~30).

Packing replaces the plain weight (memory stays one copy) unless the weight is shared (tied embeddings),
so a packed module's ``weight`` is an empty placeholder: code that needs the matrix itself must not pack it.
Without prepacking (GPUs, dtypes that are not packed here, or ``OPENINFER_CPU_PREPACK=0``), wide outputs are
split into 512-row weight blocks for 2 <= M <= 512, which measured faster than one MKL call there (2 threads:
5632 x 1024 at M=32 7.2 vs 11.1 ms); neither path changes any dot product's inputs.

Small M on a plain (unpacked) weight: ``cpu_ops.dense_gemv`` (``cpu_kernels/gemv.cpp``) streams the row-major
fp32 / bf16 weight once per call at close to the copy bandwidth. Measured on this project's AVX2 EPYC (1 thread,
the bench model's linears summed over 16 layers + lm_head, GB/s of weight bytes, median of 9 interleaved rounds;
copy bandwidth 14.7 in the same run), fp32:

| M                          | 1    | 4   | 8   | 16  | 32  | 64  |
| gemv on the row-major W    | 14.5 | 9.1 | 6.8 | 4.6 | 2.5 | 1.4 |
| oneDNN on the packed W     | 11.7 | 8.1 | 7.1 | 4.7 | 3.2 | 1.8 |
| oneDNN on the row-major W  | 14.0 | 6.3 | 5.3 | 4.0 | 2.6 | 1.5 |

Layout choice (one copy either way): fp32 was oneDNN-packed rather than row-major because batched decode
(M = 16-64, where the engine's throughput is made) runs 15-25 % slower on any row-major path, against +24 % at
M = 1; the panels now beat both at every M. ``OPENINFER_CPU_PREPACK=0`` keeps weights row-major: M <=
``GEMV_MAX_M`` runs the gemv kernel, larger M the split ``F.linear`` above.

bf16 on a CPU without native bf16 (AVX2 hosts): torch's bf16 GEMM is emulated there, 2.4-4x slower than the gemv
kernel on the row-major weight at every M measured. The weights now go into bf16 panels too (widened in registers by
a shift and a mask, ``cpu_kernels/panel_tile.h``): ``scripts/panel_gemm_speed.py --dtype bfloat16 --shapes
5632x1024 1024x2816 32000x1024 --m 1 8 32 128`` (1 thread, Zen 3) panels / gemv 1.0-1.5x at M = 1 (13-17 GB/s of
weight), 1.7-2.1x at M = 8-128 (57-92 GFLOP/s); the Llama bench model's bf16 decode step 1.16-1.44x / 1.61-1.79x /
1.82-1.99x faster at batch 1 / 8 / 32 (``scripts/profile_decode_step.py --dtype bfloat16``, ``OPENINFER_CPU_PANELS``
1 vs 0, 2 interleaved rounds). With ``OPENINFER_CPU_PANELS=0`` (or ``OPENINFER_CPU_PREPACK=0``) bf16 runs the gemv
kernel at every M as before; ``OPENINFER_CPU_GEMV=0`` turns that kernel off (the paths above without it). Known limit
of the gemv kernel: at M = 1 bf16 streams at only ~55-65 % of the copy bandwidth (fp32 at ~95-100 %, same loop
structure), so batch-1 bf16 there is ~1.1-1.3x fp32 instead of ~2x. ``scripts/decode_bandwidth.py`` measures it end
to end.

Which of these paths a weight takes is decided by ``layers/dispatch.py`` (``KernelSelection.panels``,
``onednn_prepack``, ``gemv_max_rows``) from the engine's ``KernelConfig``; the switches named above are its
environment spellings (``openinfer/envs.py``).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.layers import cpu_ops, dispatch
from openinfer.layers.quant_linear import QuantizedWeight

logger = logging.getLogger(__name__)

CPU_ROW_BLOCK = 512
_SPLIT_ROWS = (2, 512)  # the M range where splitting measured faster
# A hint for oneDNN's reorder; the packed layout serves every M (measured: hints 8/32/256 within noise).
_PACK_BATCH_HINT = 32
GEMV_MAX_M = dispatch.GEMV_MAX_M  # the gemv kernel's row bound for fp32 (KernelSelection.gemv_max_rows)


class Linear(nn.Linear):
    _packed: torch.Tensor | None = None  # oneDNN's blocked layout
    _panels: torch.Tensor | None = None  # or ours: [ceil(out / 16), in, 16] fp32 (cpu_ops.pack_panels)
    # or, bf16 on AVX512-BF16 without AMX: [1, ceil(out / 16), ceil(in / 2), 16, 2] (cpu_ops.pack_pair_panels)
    _pairs: torch.Tensor | None = None
    _quant: QuantizedWeight | None = None  # set by ``quantize`` (--quantization): the weight, packed low-bit
    # False for a module whose weight other code reads as a matrix (packing empties ``weight``).
    prepack: bool = True

    @torch.no_grad()
    def prepack_cpu(self, keep_weight: bool = False) -> bool:
        """Reorder the weight into a blocked layout (our panels for fp32 and for bf16 without native bf16, our pair
        panels for bf16 on AVX512-BF16 without AMX, oneDNN's for bf16 on AMX); returns whether it did."""
        w = self.weight
        if self._quant is not None:
            return False
        if self._packed is not None or self._panels is not None or self._pairs is not None:
            return True
        kernels = dispatch.active()
        if kernels.panels(w.device, w.dtype):
            self._panels = cpu_ops.pack_panels(w.detach())
        elif kernels.pair_panels(w.device, w.dtype):
            self._pairs = cpu_ops.pack_pair_panels(w.detach().unsqueeze(0))
        elif kernels.onednn_prepack(w.device, w.dtype):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_BATCH_HINT)
        else:
            return False
        if not keep_weight:
            self.weight = nn.Parameter(w.new_empty(0), requires_grad=False)
        return True

    @torch.no_grad()
    def quantize(self, method: str) -> None:
        """Replace the weight by its low-bit form (``quant_linear.py``); ``weight`` becomes an empty placeholder."""
        w = self.dense_weight()
        self._quant = QuantizedWeight.quantize(w.detach(), method)
        self._packed = self._panels = self._pairs = None
        self.weight = nn.Parameter(w.new_empty(0), requires_grad=False)

    @torch.no_grad()
    def load_quantized(self, qw: QuantizedWeight, part: int | None = None, sizes: list[int] | None = None) -> None:
        """A low-bit checkpoint's weight (``checkpoint_quant.py``) kept as it is: the whole ``[out, in]`` matrix, or
        part ``part`` of a fused one whose parts have ``sizes`` rows; the fused weight is assembled (rows
        concatenated in part order) once every part is in. ``weight`` becomes an empty placeholder."""
        sizes = sizes or [self.out_features]
        want = (sizes[part or 0], self.in_features)
        if tuple(qw.shape) != want:
            raise ValueError(f"quantised weight has shape {tuple(qw.shape)}, the model expects {want}")
        qw.dtype = self.weight.dtype  # what its dense form (``dense_weight``) comes back as
        if part is None:
            self._quant = qw
        else:
            parts = self.__dict__.setdefault("_quant_parts", {})
            parts[part] = qw
            if len(parts) < len(sizes):
                return
            self._quant = type(parts[0]).cat([parts[i] for i in range(len(sizes))])
            del self.__dict__["_quant_parts"]
        self._packed = self._panels = self._pairs = None
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain ``[out, in]`` matrix, packed or not (the reorder is exact both ways; a quantised
        weight comes back dequantised)."""
        if self._quant is not None:
            return self._quant.to_dense()
        if self._panels is not None:
            return cpu_ops.unpack_panels(self._panels, self.out_features)
        if self._pairs is not None:
            return cpu_ops.unpack_pair_panels(self._pairs, self.out_features, self.in_features)[0]
        return self._packed.to_dense() if self._packed is not None else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias), on whichever weight form this layer holds."""
        if self._quant is not None:
            return self._quant.matmul(x, bias)
        if self._panels is not None:
            y = cpu_ops.panel_gemm(x, self._panels, self.out_features, bias)
            return y if y is not None else F.linear(x, self.dense_weight(), bias)
        if self._pairs is not None:
            y = cpu_ops.pair_panel_linear(x, self._pairs, self.out_features, bias)
            return y if y is not None else F.linear(x, self.dense_weight(), bias)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        n = self.weight.shape[0]
        m = x.numel() // max(x.shape[-1], 1)
        if (x.device.type == "cpu" and m <= dispatch.active().gemv_max_rows(self.weight.dtype)
                and not (torch.is_grad_enabled() and self.weight.requires_grad)):  # the kernel has no backward
            y = cpu_ops.dense_gemv(x.reshape(m, x.shape[-1]), self.weight, bias)
            if y is not None:
                return y.view(*x.shape[:-1], n)
        if x.device.type != "cpu" or n <= 2 * CPU_ROW_BLOCK or not _SPLIT_ROWS[0] <= m <= _SPLIT_ROWS[1]:
            return F.linear(x, self.weight, bias)
        ws = self.weight.split(CPU_ROW_BLOCK)
        bs = bias.split(CPU_ROW_BLOCK) if bias is not None else [None] * len(ws)
        return torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs)], dim=-1)


class CheckpointLinear(Linear):
    """``Linear`` (CPU prepacking included) without the kaiming init, for models whose every weight comes from the
    checkpoint (their loaders reject missing tensors): initialising a V4-Flash-sized model at construction would
    cost minutes."""

    def reset_parameters(self) -> None:
        pass


def prepack_linears(model: nn.Module) -> int:
    """Prepack every ``Linear`` of a loaded model; a weight shared with another module (tied embeddings)
    is kept in plain form for its other user. Returns how many were packed."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    quant_users: dict[int, int] = {}  # a GGUF table shared by the embedding and a tied head stays as it is
    for module in model.modules():
        q = getattr(module, "_quant", None)
        if q is not None:
            quant_users[id(q)] = quant_users.get(id(q), 0) + 1
    packed = 0
    for module in model.modules():
        if isinstance(module, Linear) and module._quant is not None:
            repack = getattr(module._quant, "repacked", None)  # GGUF Q4_K / Q6_K: rows interleaved 8 at a time
            if repack is not None and quant_users[id(module._quant)] == 1:
                new = repack()
                packed += new is not module._quant
                module._quant = new
        elif isinstance(module, Linear) and module.prepack:
            packed += module.prepack_cpu(keep_weight=counts.get(id(module.weight), 0) > 1)
        elif not isinstance(module, Linear) and hasattr(module, "prepack_cpu"):  # e.g. stacked MoE experts
            packed += module.prepack_cpu()
    if packed:
        logger.info("prepacked %d linear weights (CPU)", packed)
    return packed


def quantize_linears(model: nn.Module, method: str) -> int:
    """``--quantization``: every ``Linear`` whose weight is only multiplied (``prepack``) and not shared, the LM
    head included, and every module with a ``quantize_weights`` of its own (stacked MoE experts), keep their weights in
    ``method``'s packed form. Embeddings (and an LM head tied to them) stay in the model dtype: a lookup reads
    one row. Call before ``prepack_linears``. Returns how many."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    done = 0
    for module in model.modules():
        if isinstance(module, Linear):
            if module.prepack and counts.get(id(module.weight), 0) <= 1 and module.weight.numel():
                module.quantize(method)
                done += 1
        elif hasattr(module, "quantize_weights"):  # e.g. stacked MoE experts
            done += module.quantize_weights(method)
    if done:
        logger.info("quantized %d linear weights to %s", done, method)
    return done


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy resident: parameters, prepacked weights and low-bit packed ones."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for m in model.modules():
        if isinstance(m, Linear) and m._packed is not None:
            total += m.in_features * m.out_features * m._packed.element_size()
        if isinstance(m, Linear) and m._panels is not None:  # zero rows up to a multiple of 16 included
            total += m._panels.numel() * m._panels.element_size()
        if isinstance(m, Linear) and m._pairs is not None:  # zero rows / column padding included
            total += m._pairs.numel() * m._pairs.element_size()
        if isinstance(m, Linear) and m._quant is not None:
            total += m._quant.nbytes
        elif not isinstance(m, Linear) and isinstance(getattr(m, "_packed", None), tuple):  # stacked experts
            total += sum(w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()
                         for ws in m._packed for w in ws)
        elif not isinstance(m, Linear) and isinstance(getattr(m, "_panels", None), tuple):  # experts in panels
            total += sum(w.numel() * w.element_size() for w in m._panels)
    return total


def num_parameters(model: nn.Module) -> int:
    """Parameter count with prepacked linears counted at their logical shape (their ``weight`` is a
    placeholder once packed)."""
    n = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        if (isinstance(m, Linear) and (m._packed is not None or m._panels is not None or m._pairs is not None
                                       or m._quant is not None) and m.weight.numel() == 0):
            n += m.in_features * m.out_features
        elif not isinstance(m, Linear) and isinstance(getattr(m, "_packed", None), tuple):  # packed experts
            n += sum(w.numel() for ws in m._packed for w in ws)
        elif not isinstance(m, Linear) and isinstance(getattr(m, "_panels", None), tuple):  # experts in panels
            p13, p2 = m._panels  # [E, 2I / 16, H, 16] (2I a multiple of 16: no padding), [E, ., I, 16]
            n += p13.numel() + p2.shape[0] * p13.shape[-2] * p2.shape[-2]
    return n
