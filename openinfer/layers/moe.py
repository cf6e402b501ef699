"""Grouped mixture-of-experts compute: tokens sorted by expert, one grouped matmul per projection.

``fused_experts`` is the fast path (on CPU at decode-sized row counts one C++ call over all experts,
``cpu_ops.moe_experts_gemv``; else ``torch._grouped_mm`` over expert-contiguous rows; no Python loop over tokens;
with ``pack_experts`` / quantized weights, one matmul per expert that has rows); ``reference_experts``
is the plain per-token loop it is tested against. Routing (which experts, which weights) is the model's business;
this file only runs the chosen experts. The expert outputs go back to token order weighted, added onto ``out``
when given (the shared expert's output), in one pass: on CPU the ``moe_combine`` kernel, a gather per token; the
torch fallback gathers too (``index_add_`` scatters serially on CPU). Both keep the scatter's roundings.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from openinfer.layers import cpu_ops
from openinfer.layers.quant_linear import QuantizedWeight

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")

# Plain row-major experts (the one resident copy) go to the one-call kernel (cpu_ops.moe_experts_gemv) while each
# expert with rows has few of them, else to torch._grouped_mm. Measured with scripts/bench_moe_experts.py (1
# thread, the V3 bench model's 16 experts top-4, H 512, I 256, AVX2 host; benchmarks/results/moe-experts-gemv-*):
# fp32, kernel / grouped_mm 0.61 / 0.74 / 0.92 at 4 / 32 / 128 rows (1-8 per expert), 1.06 / 1.21 at 256 / 512 rows
# (16 / 32 per expert): the kernel shares each weight load between 2 rows only, a GEMM blocks more. bf16:
# grouped_mm runs an emulated GEMM on AVX2 and the kernel was 1.4-2.9x faster at every size up to 512 rows, so
# bf16 takes the kernel at any size.
KERNEL_MAX_ROWS_PER_EXPERT = {torch.float32: 12, torch.bfloat16: 1 << 30}


def swiglu(gate_up: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up on a fused [.., 2I] tensor; DeepSeek-V4 clamps gate from above and up both ways. One pass
    in the CPU kernel where it can take the tensor, else ``torch_swiglu``."""
    if gate_up.dim() == 2:
        out = cpu_ops.swiglu(gate_up, swiglu_limit)
        if out is not None:
            return out
    return torch_swiglu(gate_up, swiglu_limit)


def torch_swiglu(gate_up: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return F.silu(gate) * up


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
    packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
    out: torch.Tensor | None = None,
    panels: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_* [T, K] -> [T, H].

    Each (token, expert) pair becomes one row; rows are sorted by expert so each expert's rows are
    contiguous, both projections run as grouped matmuls, and results are gathered back weighted.
    ``packed``: per-expert oneDNN-prepacked w13 / w2 (``pack_experts``, CPU), used instead of w13 / w2; ``panels``:
    the two stacks in the panel layout (``experts_on_sorted_rows``).
    ``out`` [T, H] in x's dtype: the result is added onto it, in place, and it is returned."""
    t, k = topk_ids.shape
    num_experts = (len(packed[0]) if packed is not None else panels[0].shape[0] if panels is not None
                   else w13.shape[0])
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x.index_select(0, order // k)
    counts = torch.bincount(flat, minlength=num_experts)
    y = experts_on_sorted_rows(rows, counts.tolist(), w13, w2, swiglu_limit, packed, panels)
    return combine_experts(y.to(x.dtype), order, topk_weights, out)


def experts_on_sorted_rows(rows: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor,
                           swiglu_limit: float | None,
                           packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None,
                           panels: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """rows [N, H] grouped by expert (``counts[e]`` rows for expert e, in expert order) -> expert outputs [N, H].
    ``panels``: fp32 w13 / w2 in the panel layout (``cpu_ops.pack_panels``) instead of w13 / w2: one C++ call at any
    row count (``cpu_kernels/moe_panels.cpp``)."""
    if panels is not None:
        y = cpu_ops.moe_experts_panels(rows, counts, panels[0], panels[1], swiglu_limit)
        if y is not None:
            return y
        w13 = cpu_ops.unpack_panels(panels[0], 2 * panels[1].shape[-2])
        w2 = cpu_ops.unpack_panels(panels[1], w13.shape[-1])
    if packed is not None:
        return _looped_packed(rows, packed, counts, swiglu_limit)
    active = sum(1 for n in counts if n)
    if rows.shape[0] <= KERNEL_MAX_ROWS_PER_EXPERT.get(rows.dtype, 0) * active:
        y = cpu_ops.moe_experts_gemv(rows, counts, w13, w2, swiglu_limit)
        if y is not None:
            return y
    return _grouped(rows, counts, w13, w2, swiglu_limit)


def _grouped(rows, counts, w13, w2, swiglu_limit):
    if _HAS_GROUPED_MM and rows.dtype in (torch.bfloat16, torch.float32) and rows.shape[0]:
        offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)
        h = swiglu(h, swiglu_limit)
        return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    return _looped(rows, w13, w2, counts, swiglu_limit)


def combine_experts(y: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor,
             out: torch.Tensor | None) -> torch.Tensor:
    """Token t's result: its pairs' rows of y (sorted by expert, in ``order``) times their weights (rounded to
    y's dtype), summed in fp32 in the order the rows sit in y, rounded, plus ``out[t]`` when given (the shared
    experts' output): the roundings of the ``y * w`` + ``index_add_`` scatter this replaces, so either path
    gives the other's bits. As a gather per token (CPU kernel, else the torch code below) because
    ``index_add_`` scatters serially on CPU."""
    t, k = topk_weights.shape
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    w = topk_weights.float()
    dst = out if out is not None else torch.empty(t, y.shape[1], dtype=y.dtype, device=y.device)
    if cpu_ops.moe_combine(dst, y, inv, w, accumulate=out is not None):
        return dst
    pos, j = inv.view(t, k).sort(dim=1)
    yw = (y[pos.reshape(-1)].view(t, k, -1) * w.gather(1, j).to(y.dtype)[..., None]).float()
    acc = yw[:, 0]
    for i in range(1, k):  # K adds in fp32, in row order, as index_add_ sums them
        acc = acc + yw[:, i]
    if out is None:
        return acc.to(y.dtype)
    return out.copy_(acc.to(y.dtype) + out)


def _looped(rows, w13, w2, counts, swiglu_limit):
    out = torch.empty(rows.shape[0], w2.shape[1], dtype=rows.dtype, device=rows.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            seg = rows[start:start + n]
            out[start:start + n] = swiglu(seg @ w13[e].t(), swiglu_limit) @ w2[e].t()
            start += n
    return out


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each expert's two matrices reordered once into oneDNN's blocked layout (linear.py says why). The model
    no longer packs its experts: the plain row-major stack with ``moe_experts_gemv`` at small row counts and
    ``torch._grouped_mm`` at large ones measured faster at every batch (KERNEL_MAX_ROWS_PER_EXPERT); kept for
    callers that pass ``packed`` to ``fused_experts``."""
    from openinfer.layers.linear import _PACK_BATCH_HINT

    reorder = torch.ops.mkldnn._reorder_linear_weight
    return ([reorder(w13[e].contiguous(), _PACK_BATCH_HINT) for e in range(w13.shape[0])],
            [reorder(w2[e].contiguous(), _PACK_BATCH_HINT) for e in range(w2.shape[0])])


def _looped_packed(rows, packed, counts, swiglu_limit):
    """Experts with rows, one prepacked oneDNN matmul per projection (a loop over experts, never tokens)."""
    p13, p2 = packed
    linear = torch.ops.mkldnn._linear_pointwise

    def mm(x, w):  # --quantization: the experts are low-bit QuantizedWeights (DeepseekExperts.quantize_weights)
        return w.matmul(x) if isinstance(w, QuantizedWeight) else linear(x, w, None, "none", [], "")

    out = torch.empty(rows.shape[0], p2[0].shape[0], dtype=rows.dtype, device=rows.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            seg = rows[start:start + n]
            h = swiglu(mm(seg, p13[e]), swiglu_limit)
            out[start:start + n] = mm(h, p2[e])
            start += n
    return out


def reference_experts(x, w13, w2, topk_weights, topk_ids, swiglu_limit=None) -> torch.Tensor:
    """Token by token, expert by expert, in fp32: what ``fused_experts`` must equal."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for i in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[i, j])
            h = torch_swiglu(x[i].float() @ w13[e].float().t(), swiglu_limit)
            out[i] += float(topk_weights[i, j]) * (h @ w2[e].float().t())
    return out.to(x.dtype)
