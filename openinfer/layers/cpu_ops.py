"""The C++ CPU kernels' Python wrappers (``cpu_kernels/``): one function per op, in the layout each kernel takes.

Which ops run these kernels is decided once, at load, by ``layers/dispatch.py`` (from ``KernelConfig`` and the
platform); ``get_ops()`` is that decision's kernel namespace, None on the torch backend. Each wrapper returns None
(or False) when there is no kernel namespace or when the call's tensors are not what the kernel takes (a GPU tensor,
a dtype mix, a layout): the caller then runs its torch code for that call.
"""
from __future__ import annotations

import math

import torch

from openinfer.layers import dispatch


def get_ops():
    """The ``torch.ops.openinfer_cpu`` namespace of the active selection, None on the torch backend."""
    return dispatch.active().ops


def available() -> bool:
    return get_ops() is not None


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Single-query attention over the paged cache. q: [B, Hq, D] (last dim contiguous); caches
    ``[num_blocks, block_size, Hk, D]``; block_tables [B, max_blocks] int64; seq_lens [B] int64. Returns
    [B, Hq, D] in q's dtype (written into ``out`` when given), or None when the kernel is unavailable
    (disabled, unbuildable, or a non-CPU tensor) so the caller takes its torch path."""
    if q.device.type != "cpu":
        return None
    ops = get_ops()
    if ops is None:
        return None
    if q.stride(-1) != 1:
        q = q.contiguous()
    dst = out if out is not None and out.stride(-1) == 1 else torch.empty(q.shape, dtype=q.dtype)
    ops.paged_decode_attention(dst, q, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(),
                               float(scale))
    if out is not None and dst is not out:
        out.copy_(dst)
    return out if out is not None else dst


def mla_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, v_dim: int,
                         out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Absorbed MLA decode over the paged latent cache (``cpu_kernels/mla_decode.cpp``). q: [B, H, D] with
    D = kv_lora_rank + rope (= the cache's last dim); the values are each row's first ``v_dim`` entries.
    Returns [B, H, v_dim] in q's dtype, or None when the kernel cannot take the call (the caller keeps its
    torch path). q and ``out`` may be strided over B and H (e.g. head-major views): the kernel reads and
    writes through their strides; ``out`` [B, H, v_dim] with a contiguous last dim is written in place."""
    ops = ops_for(q, kv_cache)
    if ops is None or kv_cache.dim() != 3 or not kv_cache.is_contiguous() or q.shape[-1] != kv_cache.shape[-1]:
        return None
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], v_dim, dtype=q.dtype)
    elif (tuple(out.shape) != (q.shape[0], q.shape[1], v_dim) or out.dtype != q.dtype or out.stride(-1) != 1
          or out.device.type != "cpu"):
        raise ValueError(f"mla_decode_attention: out must be a CPU {q.dtype} [{q.shape[0]}, {q.shape[1]}, "
                         f"{v_dim}] with a contiguous last dim, got {out.dtype} {tuple(out.shape)} "
                         f"strides {out.stride()}")
    ops.mla_decode_attention(out, q, kv_cache, block_tables.contiguous(), seq_lens.contiguous(), float(scale))
    return out


def mla_prefill_attention(out: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                          k_pe: torch.Tensor, scale: float) -> bool:
    """Causal MLA prefill attention on decompressed K / V (``cpu_kernels/mla_prefill.cpp``), written into out
    [n, H, Dv]; q_nope [n, H, Dn], q_pe [n, H, R], kv [ctx, H * (Dn + Dv)] (latents @ kv_b^T), k_pe [ctx, R]; query i
    at position ctx - n + i. False when the kernel cannot take the call (not fp32, unbuilt kernels, Dv not a
    multiple of two vectors): the caller runs SDPA."""
    ops = ops_for(out, q_nope, kv)
    if ops is None or q_nope.dtype != torch.float32:
        return False
    return bool(ops.mla_prefill_attention(out, q_nope, q_pe, kv, k_pe, float(scale)))


# ---- fused per-layer ops (cpu_kernels/layer_ops.cpp) --------------------------------------------------------
# Each returns None / False when the kernel cannot take the call (disabled or unbuilt kernels, a GPU tensor, a
# layout or dtype mix the kernel does not handle), and the caller runs its torch code instead.

def _rows(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1


def ops_for(*tensors: torch.Tensor):
    """The op namespace when every tensor is on the CPU and the kernels are available, else None."""
    for t in tensors:  # a loop, not any(<genexpr>): this runs ~80 times per decode step
        if t.device.type != "cpu":
            return None
    return dispatch.active().ops


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """In place: residual += x (rounded to its dtype), then x = RMSNorm(residual) * weight. [T, D] each."""
    ops = ops_for(x, residual)
    if (ops is None or not (_rows(x) and _rows(residual)) or x.shape != residual.shape
            or not (x.dtype == residual.dtype == weight.dtype)):
        return False
    ops.add_rms_norm(x, residual, weight, float(eps))
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm(x) * weight into a new [T, D] tensor."""
    ops = ops_for(x)
    if ops is None or not _rows(x) or x.dtype != weight.dtype:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    ops.rms_norm(out, x, weight, float(eps))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[:, :d]) * x[:, d:] into a new [T, d] tensor."""
    ops = ops_for(x)
    if ops is None or not _rows(x) or x.shape[1] % 2:
        return None
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    ops.silu_and_mul(out, x)
    return out


def rotary_cache_write_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        num_heads: int, num_kv_heads: int, head_dim: int, rot_dim: int) -> bool:
    """In place on a fused [T, (Hq + 2 Hk) * D] projection: rotary on the q and k heads (NeoX layout, first
    rot_dim dims, fp32 cos/sin tables [max_pos, rot_dim / 2]), then k and v copied into the paged caches at
    ``slot_mapping`` (float8_e4m3fn caches: saturated and rounded as ``kv_quant.to_cache`` does)."""
    ops = ops_for(qkv, k_cache)
    if (ops is None or not _rows(qkv) or k_cache.dtype not in (qkv.dtype, torch.float8_e4m3fn)
            or cos.dtype != torch.float32
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return False
    ops.rotary_cache_write(qkv, positions.contiguous(), cos, sin, k_cache, v_cache, slot_mapping.contiguous(),
                           num_heads, num_kv_heads, head_dim, rot_dim)
    return True


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool,
                     deinterleave: bool) -> torch.Tensor | None:
    """``rotary.apply_interleaved`` as one op (same bits) into a new contiguous tensor shaped as x [T, ..., D];
    fp32 cos / sin [T, half]. None when the kernel cannot take the call."""
    ops = ops_for(x, cos)
    if (ops is None or x.dim() < 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.dim() != 2
            or cos.shape != sin.shape or cos.shape[0] != x.shape[0] or 2 * cos.shape[1] > x.shape[-1]):
        return None
    x3 = x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])
    x3 = x3 if x3.shape[-1] <= 1 or x3.stride(-1) == 1 else x3.contiguous()
    out = torch.empty(x3.shape, dtype=x.dtype)
    ops.rope_interleaved(out, x3, cos.contiguous(), sin.contiguous(), inverse, deinterleave)
    return out.view(x.shape)


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """Index of each row's first maximum (a NaN counts as the maximum, as in ``torch.max(dim)``), read in x's
    own dtype: greedy decoding needs no fp32 copy of the logits."""
    ops = ops_for(x)
    if ops is None or not _rows(x) or x.shape[1] == 0:
        return None
    out = torch.empty(x.shape[0], dtype=torch.long)
    ops.argmax_rows(out, x)
    return out


# ---- mixture-of-experts pieces (cpu_kernels/moe_ops.cpp) ---------------------------------------------------------

def moe_select(scores: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int,
               topk_group: int) -> torch.Tensor | None:
    """DeepSeek's noaux_tc expert choice on fp32 scores [T, E] (see moe_ops.cpp) -> ids int64 [T, K], ties
    towards the lowest expert index."""
    ops = ops_for(scores)
    if ops is None or scores.dim() != 2 or scores.dtype != torch.float32:
        return None
    ids = torch.empty(scores.shape[0], top_k, dtype=torch.long)
    ops.moe_select(ids, scores.contiguous(), None if bias is None else bias.float().contiguous(), n_group,
                   topk_group)
    return ids


def swiglu(x: torch.Tensor, limit: float | None) -> torch.Tensor | None:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) on a fused [T, 2I] gate|up tensor (no clamp when limit
    is None) into a new [T, I] tensor."""
    ops = ops_for(x)
    if ops is None or not _rows(x) or x.shape[1] % 2 or x.dtype not in _FLOAT_TYPES:
        return None
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    ops.swiglu(out, x, float("inf") if limit is None else float(limit))
    return out


def moe_combine(out: torch.Tensor, y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor,
                accumulate: bool) -> bool:
    """In place: out[t] = sum_k dt(dt(weights[t, k]) * y[inv[t * K + k]]) (+ out[t] if accumulate), added in the
    order of the rows in y, rounded to out's dtype after each add (``moe._combine`` says why). Returns False
    when the kernel cannot take the call."""
    ops = ops_for(out, y)
    if (ops is None or not (_rows(out) and _rows(y)) or out.dtype != y.dtype or out.dtype not in _FLOAT_TYPES
            or weights.dtype != torch.float32):
        return False
    ops.moe_combine(out, y, inv.contiguous(), weights.contiguous(), accumulate)
    return True


_FLOAT_TYPES = (torch.float32, torch.bfloat16, torch.float16)


def sink_sparse_attention(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, token_seq: torch.Tensor,
                          positions: torch.Tensor, block_size: int, window: int, entries: torch.Tensor | None,
                          entry_slots: torch.Tensor | None, sinks: torch.Tensor,
                          scale: float, ds_mla=None) -> torch.Tensor | None:
    """DeepSeek-V4 attention (``cpu_kernels/sparse_attention.cpp``): per query, its sequence's last ``window``
    positions read from the flat token store ``kv`` [slots, d] through ``tables``, plus the entry rows
    ``entry_slots`` [T, E] (-1 = none) of ``entries``, softmax with a per-head sink logit. q [T, H, d] -> [T, H, d]
    in q's dtype, or None when the kernel cannot take the call. ``ds_mla`` (a ``kv_quant.DsMlaLayout``): kv and
    entries are uint8 [slots, row_bytes] fp8_ds_mla rows, widened in registers."""
    ops = ops_for(q, kv)
    if ops is None or q.dim() != 3 or not kv.is_contiguous() or q.dtype not in _FLOAT_TYPES:
        return None
    if ds_mla is not None and (kv.dtype != torch.uint8 or kv.shape[-1] != ds_mla.row_bytes):
        return None
    if entries is not None and (entries.dtype != kv.dtype or not entries.is_contiguous()):
        return None
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    ops.sink_sparse_attention(out, q, kv, tables.contiguous(), token_seq.contiguous(), positions.contiguous(),
                              int(block_size), int(window), entries,
                              None if entry_slots is None else entry_slots.contiguous(), sinks.float().contiguous(),
                              float(scale), ds_mla.nope if ds_mla else 0, ds_mla.rope if ds_mla else 0)
    return out


def indexer_topk(q: torch.Tensor, head_w: torch.Tensor, keys: torch.Tensor, seq_slots: torch.Tensor,
                 token_seq: torch.Tensor, visible: torch.Tensor, k: int, scale: float) -> torch.Tensor | None:
    """V4 lightning indexer (``cpu_kernels/indexer_topk.cpp``): per query t, scores sum_h head_w[t, h] *
    relu(q[t, h] . keys[seq_slots[token_seq[t], w]]) * scale over w < visible[t], and their top k (descending,
    ties -> lowest w, -1 past visible). -> ids int64 [T, k], or None when the kernel cannot take the call.
    uint8 keys [slots, d + 4]: fp8 rows with an fp32 scale each (kv_quant.Fp8RowLayout)."""
    ops = ops_for(q, keys)
    if ops is None or q.dim() != 3 or q.dtype not in _FLOAT_TYPES or keys.dtype not in (*_FLOAT_TYPES, torch.uint8):
        return None
    if q.stride(-1) != 1:
        q = q.contiguous()
    ids = torch.empty(q.shape[0], k, dtype=torch.long)
    ops.indexer_topk(ids, q, head_w.float().contiguous(), keys.contiguous(), seq_slots.contiguous(),
                     token_seq.contiguous(), visible.contiguous(), float(scale))
    return ids


def indexer_select(q: torch.Tensor, head_w: torch.Tensor, keys: torch.Tensor, tables: torch.Tensor,
                   token_seq: torch.Tensor, visible: torch.Tensor, k: int, scale: float, ratio: int,
                   block_size: int, cap: int, candidate_block: int = 0, num_blocks: int = 0,
                   allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """V4.1 lightning indexer (``cpu_kernels/indexer_select.cpp``): per query t, scores sum_h head_w[t, h] *
    relu(q[t, h] . keys[slot]) * scale of its sequence's entries w < visible[t] (slot from the block ``tables``
    as ``StepIndex.entry_slots``), restricted to the blocks of ``candidate_block`` entries listed in ``allowed``
    [T, B] (-1 = none) when given. -> (ids int64 [T, k]: the top k, descending, ties -> lowest w, -1 pads;
    blocks int64 [T, num_blocks]: the candidate blocks, newest visible first-class, or None when num_blocks is 0),
    or None when the kernel cannot take the call."""
    ops = ops_for(q, keys)
    if (ops is None or q.dim() != 3 or q.dtype not in _FLOAT_TYPES or keys.dtype not in _FLOAT_TYPES
            or keys.dim() != 2 or keys.shape[1] != q.shape[2]):
        return None
    if q.stride(-1) != 1:
        q = q.contiguous()
    t = q.shape[0]
    ids = torch.empty(t, k, dtype=torch.long)
    blocks = torch.empty(t, num_blocks, dtype=torch.long)
    allowed = torch.empty(t, 0, dtype=torch.long) if allowed is None else allowed.contiguous()
    ops.indexer_select(ids, blocks, q, head_w.float().contiguous(), keys.contiguous(), tables.contiguous(), token_seq.contiguous(),
                       visible.contiguous(), allowed, int(ratio), int(block_size), int(cap), int(candidate_block),
                       float(scale))
    return ids, (blocks if num_blocks else None)


# ---- fp32 / bf16 GEMM on 16-column weight panels (cpu_kernels/panel_gemm.cpp, moe_panels.cpp) ------------------

PANEL = 16  # output columns per panel


def panels_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of this dtype go into the panel layout (``KernelSelection.panels`` decides)."""
    return dispatch.active().panels(device, dtype)


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """[..., N, K] -> the panel layout [..., ceil(N / 16), K, 16] (rows past N zero), in w's dtype, contiguous: panel
    p row k holds w[..., 16p:16p + 16, k], for bf16 in the order c0 c8 c1 c9 ... c7 c15 (the kernel widens one
    32-byte load with a shift and a mask: ``cpu_kernels/panel_tile.h``). Exact: ``unpack_panels`` gives ``w`` back."""
    n, k = w.shape[-2:]
    np_ = -(-n // PANEL)
    padded = w.new_zeros(*w.shape[:-2], np_ * PANEL, k)
    padded[..., :n, :] = w
    wp = padded.view(*w.shape[:-2], np_, PANEL, k).transpose(-1, -2)
    if w.dtype == torch.bfloat16:
        wp = wp.unflatten(-1, (2, PANEL // 2)).transpose(-1, -2).flatten(-2)
    return wp.contiguous()


def unpack_panels(wp: torch.Tensor, n: int) -> torch.Tensor:
    """The [..., N, K] matrix a ``pack_panels`` layout holds."""
    np_, k = wp.shape[-3:-1]
    if wp.dtype == torch.bfloat16:
        wp = wp.unflatten(-1, (PANEL // 2, 2)).transpose(-1, -2).flatten(-2)
    return wp.transpose(-1, -2).reshape(*wp.shape[:-3], np_ * PANEL, k)[..., :n, :].contiguous()


def panel_gemm(x: torch.Tensor, wp: torch.Tensor, n: int, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., K] W^T (+ bias) -> [..., n] for W in panels ``wp`` [NP, K, 16] (one op: the reshapes and the allocation
    happen in C++); or, batched, x [H, M, K] and wp [H, NP, K, 16] -> [H, M, n], x and ``out`` possibly strided views
    with unit stride in the last dim (no bias). fp32 or bf16, x in wp's dtype; None when the kernel cannot take the
    call (the caller unpacks or runs its torch path)."""
    ops = ops_for(x, wp)
    if ops is None or wp.dtype not in (torch.float32, torch.bfloat16) or x.dtype != wp.dtype:
        return None
    if wp.dim() == 3:
        if out is not None:
            raise ValueError("panel_gemm: out is only for the batched form (wp [H, NP, K, 16])")
        return ops.panel_linear(x, wp, n, None if bias is None else bias.to(wp.dtype))
    if bias is not None:
        return None
    x3 = x if x.stride(-1) == 1 else x.contiguous()
    y = out if out is not None else x.new_empty(x3.shape[0], x3.shape[1], n)
    ops.panel_gemm(y, x3, wp, None)
    return y


def pack_pair_panels(w: torch.Tensor) -> torch.Tensor:
    """[..., N, K] bf16 -> the pair-panel layout [..., ceil(N / 16), ceil(K / 2), 16, 2], contiguous: panel p, pair k
    holds w[..., 16p + c, 2k + j] at [c, j] (rows past N and the column past an odd K zero), one 64-byte vdpbf16ps
    operand per pair (``cpu_kernels/pair_panel_gemm.cpp``). Exact: a permutation of w's values and zeros."""
    n, k = w.shape[-2:]
    np_, kp = -(-n // PANEL), -(-k // 2)
    padded = w.new_zeros(*w.shape[:-2], np_ * PANEL, kp * 2)
    padded[..., :n, :k] = w
    return padded.view(*w.shape[:-2], np_, PANEL, kp, 2).transpose(-3, -2).contiguous()


def pair_panel_gemm(x: torch.Tensor, wq: torch.Tensor, n: int, out: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [H, M, K] W^T (+ bias [n], H = 1) -> [H, M, n] for per-head W in pair panels ``wq`` [H, NP, KP, 16, 2]
    (``pack_pair_panels``), bf16 (the bias added before the one rounding), x and ``out`` possibly strided views with
    unit stride in the last dim; None when the kernel cannot take the call (not built, not bf16, not on the CPU: the
    caller runs torch)."""
    ops = ops_for(x, wq)
    if ops is None or not dispatch.active().pair_panels_built or x.dtype != torch.bfloat16 or wq.dtype != x.dtype:
        return None
    x3 = x if x.stride(-1) == 1 else x.contiguous()
    y = out if out is not None else x.new_empty(x3.shape[0], x3.shape[1], n)
    ops.pair_panel_gemm(y, x3, wq, bias)
    return y


def pair_panel_linear(x: torch.Tensor, wq: torch.Tensor, n: int, bias: torch.Tensor | None = None
                      ) -> torch.Tensor | None:
    """x [..., K] W^T (+ bias) -> [..., n] for one W in pair panels ``wq`` [1, NP, KP, 16, 2] (``pair_panel_gemm``
    on x's rows as one head); None when the kernel cannot take the call."""
    y = pair_panel_gemm(x.reshape(1, -1, x.shape[-1]), wq, n, bias=bias)
    return None if y is None else y.view(*x.shape[:-1], n)


def unpack_pair_panels(wq: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [..., n, k] matrix a ``pack_pair_panels`` layout holds."""
    *lead, np_, kp, _, _ = wq.shape
    return wq.transpose(-3, -2).reshape(*lead, np_ * PANEL, kp * 2)[..., :n, :k]


def moe_experts_panels(rows: torch.Tensor, counts: list[int], p13: torch.Tensor, p2: torch.Tensor,
                       limit: float | None) -> torch.Tensor | None:
    """swiglu(rows W13[e]^T) W2[e]^T for rows [R, H] sorted by expert (``counts[e]`` rows for expert e), W13 and W2
    in panels (``pack_panels``: p13 [E, 2I / 16, H, 16], p2 [E, ceil(H / 16), I, 16], I a multiple of 16), fp32 or
    bf16, rows in their dtype; -> [R, H], or None when the kernel cannot take the call."""
    ops = ops_for(rows, p13, p2)
    if (ops is None or rows.dtype not in (torch.float32, torch.bfloat16) or rows.dtype != p13.dtype
            or rows.dim() != 2 or p2.shape[-2] % PANEL):
        return None
    out = torch.empty(rows.shape[0], rows.shape[1], dtype=rows.dtype)
    ops.moe_experts_panels(out, rows.contiguous(), torch.tensor(counts, dtype=torch.long), p13, p2,
                           float("inf") if limit is None else float(limit))
    return out


# ---- small-M dense linear (cpu_kernels/gemv.cpp) -----------------------------------------------------------------

GEMV_DTYPES = (torch.float32, torch.bfloat16)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [M, K] W^T (+ bias) for a plain row-major ``weight`` [N, K] in fp32 or bf16, x and bias in its dtype;
    -> [M, N], or None when the kernel cannot take the call (the caller runs F.linear)."""
    ops = ops_for(x, weight)
    if (ops is None or x.dim() != 2 or weight.dtype not in GEMV_DTYPES or x.dtype != weight.dtype
            or not weight.is_contiguous() or (bias is not None and bias.dtype != weight.dtype)):
        return None
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    ops.dense_gemv(y, x.contiguous(), weight, None if bias is None else bias.contiguous())
    return y


# ---- routed experts at small row counts (cpu_kernels/moe_gemv.cpp) -----------------------------------------------

def moe_experts_gemv(rows: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor,
                     limit: float | None) -> torch.Tensor | None:
    """swiglu(rows W13[e]^T) W2[e]^T for rows [R, H] sorted by expert (``counts[e]`` rows for expert e), w13
    [E, 2I, H] and w2 [E, H, I] plain row-major fp32 / bf16, rows in their dtype; -> [R, H], or None when the
    kernel cannot take the call (the caller runs its torch path). bf16 runs on AVX512-BF16 dot products where the
    selection says so (``KernelSelection.moe_bf16_dot``)."""
    ops = ops_for(rows, w13, w2)
    if (ops is None or rows.dim() != 2 or w13.dim() != 3 or w13.dtype not in GEMV_DTYPES
            or not (rows.dtype == w13.dtype == w2.dtype) or not (w13.is_contiguous() and w2.is_contiguous())):
        return None
    out = torch.empty(rows.shape[0], w2.shape[1], dtype=rows.dtype)
    ops.moe_experts_gemv(out, rows.contiguous(), torch.tensor(counts, dtype=torch.long), w13, w2,
                         float("inf") if limit is None else float(limit), dispatch.active().moe_bf16_dot)
    return out
