"""Grouped mixture-of-experts compute: tokens sorted by expert, one grouped matmul per projection.

``fused_experts`` is the fast path (``torch._grouped_mm`` over expert-contiguous rows, no Python loop over
tokens; on CPU, with ``pack_experts`` weights, one oneDNN matmul per expert that has rows); ``reference_experts``
is the plain per-token loop it is tested against. Routing (which experts, which weights) is the model's business;
this file only runs the chosen experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def swiglu(gate_up: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up on a fused [.., 2I] tensor; DeepSeek-V4 clamps gate from above and up both ways."""
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
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_* [T, K] -> [T, H].

    Each (token, expert) pair becomes one row; rows are sorted by expert so each expert's rows are
    contiguous, both projections run as grouped matmuls, and results are scattered back weighted.
    ``packed``: per-expert oneDNN-prepacked w13 / w2 (``pack_experts``, CPU), used instead of w13 / w2."""
    t, k = topk_ids.shape
    num_experts = len(packed[0]) if packed is not None else w13.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x[order // k]
    counts = torch.bincount(flat, minlength=num_experts)
    if packed is not None:
        y = _looped_packed(rows, packed, counts.tolist(), swiglu_limit)
    elif _HAS_GROUPED_MM and x.dtype in (torch.bfloat16, torch.float32):
        offs = counts.cumsum(0).to(torch.int32)
        h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)
        h = swiglu(h, swiglu_limit)
        y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    else:
        y = _looped(rows, w13, w2, counts.tolist(), swiglu_limit)
    y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
    out = torch.zeros(t, x.shape[1], dtype=y.dtype, device=x.device)
    out.index_add_(0, order // k, y)
    return out.to(x.dtype)


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
    """Each expert's two matrices reordered once into oneDNN's blocked layout (linear.py says why). On CPU,
    ``torch._grouped_mm`` runs one plain matmul per expert anyway; the packed ones measured faster at the few
    rows per expert that decoding gives."""
    from openinfer.layers.linear import _PACK_BATCH_HINT

    reorder = torch.ops.mkldnn._reorder_linear_weight
    return ([reorder(w13[e].contiguous(), _PACK_BATCH_HINT) for e in range(w13.shape[0])],
            [reorder(w2[e].contiguous(), _PACK_BATCH_HINT) for e in range(w2.shape[0])])


def _looped_packed(rows, packed, counts, swiglu_limit):
    """Experts with rows, one prepacked oneDNN matmul per projection (a loop over experts, never tokens)."""
    p13, p2 = packed
    linear = torch.ops.mkldnn._linear_pointwise
    out = torch.empty(rows.shape[0], p2[0].shape[0], dtype=rows.dtype, device=rows.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            seg = rows[start:start + n]
            h = swiglu(linear(seg, p13[e], None, "none", [], ""), swiglu_limit)
            out[start:start + n] = linear(h, p2[e], None, "none", [], "")
            start += n
    return out


def reference_experts(x, w13, w2, topk_weights, topk_ids, swiglu_limit=None) -> torch.Tensor:
    """Token by token, expert by expert, in fp32: what ``fused_experts`` must equal."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for i in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[i, j])
            h = swiglu(x[i].float() @ w13[e].float().t(), swiglu_limit)
            out[i] += float(topk_weights[i, j]) * (h @ w2[e].float().t())
    return out.to(x.dtype)
