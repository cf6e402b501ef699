"""Whole decode-step blocks as one C++ op each (``cpu_kernels/decode_blocks.cpp``): a DeepSeek layer's MLA attention
and its MoE, and a whole Llama-family decoder layer. They run the same kernels and ATen calls as the modules' Python
path, in the same order, so the results are the same bits; what they remove is the Python between the calls (about
0.7 ms per DeepSeek layer at batch 1 on the bench host, where the layer's weights stream in ~1 ms; ~0.3 ms per Llama
layer, ~10 % of a batch-1 step of the Llama bench checkpoint).

Each function returns None when the block cannot take the call, and the module runs its Python path: not on the
CPU, kernels unavailable or ``OPENINFER_CPU_KERNELS=0``, ``OPENINFER_DECODE_BLOCKS=0``, a step with a prefill in
it, more than one rank, weights not in the panel layout (native-bf16 oneDNN, MXFP4 / FP8 experts, quantised ones
other than the Llama block's W4A8 / W8A8 / weight-only int8 / symmetric int4 / GGUF linears (a fused GGUF projection
of two types included: each part's kernel writes its columns), and the weight-only ones from the row count where their
Python path decodes to fp32), biases, an fp8 cache (DeepSeek attention) or a cache in another dtype than the
activations (Llama), Qwen3's q / k norms.
"""
from __future__ import annotations

import math

import torch

from openinfer.forward_context import get_forward_context
from openinfer.layers import cpu_ops, dispatch
from openinfer.layers.gguf_quant import GGUF_DEQUANT_ROWS, GGUFWeight
from openinfer.layers.quant_linear import LOWBIT_DEQUANT_ROWS


def enabled() -> bool:
    """Whether the active kernel selection runs the fused blocks (``KernelSelection.decode_blocks``)."""
    return dispatch.active().decode_blocks


def decode_only_step(x: torch.Tensor):
    """The step's forward context when a block may take it: blocks on, x on the CPU, a step of decodes only (x one
    row per decoding sequence); else None."""
    if x.device.type != "cpu" or not enabled():
        return None
    md = get_forward_context()
    if md.prefills or not md.num_decodes or md.num_decodes != x.shape[0]:
        return None
    return md


def linear_panels(linear) -> torch.Tensor | None:
    """A ``Linear``'s weight in the panel layout when that is all its matmul needs (no bias, not quantised)."""
    if linear._quant is not None or linear.bias is not None:
        return None
    return linear._panels


def mla_decode_block(x: torch.Tensor, q_a: torch.Tensor | None, q_a_norm, q_b: torch.Tensor, q_b_n: int,
                     kv_a: torch.Tensor, kv_a_norm, absorbed: tuple[torch.Tensor, ...],
                     o_proj: torch.Tensor, hidden: int, cos: torch.Tensor, sin: torch.Tensor, mla, md,
                     lora_eps: float) -> torch.Tensor | None:
    """o_proj(MLA attention(x)) for a decode-only step: ``q_a`` / ``kv_a`` / ``q_b`` / ``o_proj`` panels, the two
    norms (``RMSNorm`` modules), MLA's absorbed W_UK / W_UV panels, ``mla`` the layer's ``MLAAttention``, ``md`` the
    step's metadata."""
    ops = cpu_ops.get_ops()
    cache = mla.kv_cache
    if (ops is None or cache is None or cache.dtype != x.dtype or x.dim() != 2 or cos.dtype != torch.float32
            or (q_a is not None and q_a_norm.weight.dtype != x.dtype) or kv_a_norm.weight.dtype != x.dtype):
        return None
    tables = md.group(mla.kv_group)
    return ops.mla_decode_block(
        x, q_a, None if q_a is None else q_a_norm.weight, q_b, q_b_n, kv_a, kv_a_norm.weight, absorbed[0],
        absorbed[1], o_proj, hidden, cos, sin, cache, tables.slot_mapping, tables.decode_block_tables,
        md.decode_seq_lens, mla.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank,
        mla.v_head_dim, float(lora_eps), float(mla.scale))


SCORING = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}


def moe_block(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None, cfg,
              shared: tuple[torch.Tensor, torch.Tensor, int] | None, panels: tuple[torch.Tensor, torch.Tensor],
              limit: float | None) -> torch.Tensor | None:
    """DeepseekMoE's output for x [T, H] on one rank: router with ``cfg`` (a ``RouterConfig``), the shared expert's
    (gate_up panels, down panels, intermediate size), the routed experts' (w13, w2) panels."""
    ops = cpu_ops.get_ops()
    if ops is None or x.dim() != 2 or panels[0].dtype != x.dtype or panels[1].shape[-2] % cpu_ops.PANEL:
        return None
    return ops.moe_block(
        x, gate_w, bias, SCORING[cfg.scoring_func], cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
        cfg.norm_topk_prob, float(cfg.routed_scaling_factor), None if shared is None else shared[0],
        None if shared is None else shared[1], 0 if shared is None else shared[2], panels[0], panels[1],
        math.inf if limit is None else float(limit))


# how cpu_kernels/decode_blocks.cpp's layer_linear runs each Llama linear
LINEAR_KINDS = {"panels": 0, "w4a8": 1, "w8a8": 2, "int8": 3, "int4": 4, "gguf": 5, "gguf_q8": 6, "gguf_parts": 7}


def layer_linear(linear) -> tuple[torch.Tensor, torch.Tensor | None, int, int] | None:
    """A ``Linear`` as the Llama block takes it, ``(weight, scales, kind, group)``: its panels, or a low-bit weight
    (the kernels ``QuantizedWeight.matmul`` calls: W4A8 / W8A8, weight-only int8 / symmetric int4); None for the rest
    (biases, int4 with zero points, weights not in the panel layout)."""
    q = linear._quant
    if q is None:
        panels = linear_panels(linear)
        return None if panels is None else (panels, None, LINEAR_KINDS["panels"], 0)
    if linear.bias is not None or getattr(q, "method", None) not in LINEAR_KINDS:
        return None
    if q.method == "gguf":  # a GGUF file's blocks as they are, with the kernel GGUFWeight.matmul picks
        int8 = dispatch.active().gguf_int8
        # a repacked weight (GGUFWeight.repacked: only under int8 everywhere) has int8 activations at every M; its
        # rows padded to a multiple of 8 leave it to the Python path (the block's linears have n rows of data)
        parts = [q] if isinstance(q, GGUFWeight) else q.parts
        if any(p.layout == "r8" and p.data.shape[0] != p.shape[0] for p in parts):
            return None
        if isinstance(q, GGUFWeight):
            return q.data, None, LINEAR_KINDS["gguf_q8" if int8 or q.layout == "r8" else "gguf"], q.code
        # a fused weight of mixed types (GGUFWeightParts): its parts' bytes and a table (code, rows, int8) per part;
        # _llama_layer_weights appends the parts to the layer's weight list and points ``group`` at them
        table = torch.tensor([[p.code, p.shape[0], int(int8 or p.layout == "r8")] for p in q.parts],
                             dtype=torch.int64)
        return [p.data for p in q.parts], table, LINEAR_KINDS["gguf_parts"], 0
    if q.zero_corr is not None:
        return None
    return q.qweight, q.scales, LINEAR_KINDS[q.method], q.group


def _max_rows(lins) -> float:
    """The row count from which a step leaves these linears to their Python path: weight-only int8 / int4 switch
    to a decoded GEMM from ``LOWBIT_DEQUANT_ROWS`` rows, which the block does not do (inf: no such linear)."""
    kinds = {v: k for k, v in LINEAR_KINDS.items()}
    rows = dict(LOWBIT_DEQUANT_ROWS, gguf=GGUF_DEQUANT_ROWS, gguf_q8=GGUF_DEQUANT_ROWS, gguf_parts=GGUF_DEQUANT_ROWS)
    return min((rows.get(kinds[lin[2]], math.inf) for lin in lins), default=math.inf)


def _llama_layer_weights(layer) -> tuple | None:
    """The block's per-layer constants (the four linears as lists, the norms, the shapes), or None when the layer's
    weights do not fit the block. Built once per layer, at its first decode step (after loading and quantisation; the
    weights do not change after that): resolving ~25 module attributes each step was ~20 us per layer."""
    attn, mlp = layer.self_attn, layer.mlp
    a, rot = attn.attn, attn.rotary_emb
    lins = [layer_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(p is None for p in lins) or rot.cos.dtype != torch.float32 or norms[0].dtype != norms[1].dtype:
        return None
    weights, scales, kinds, groups = (list(t) for t in zip(*lins))
    extra: list[torch.Tensor] = []
    for i, w in enumerate(weights):  # GGUF parts: after the four linears, ``group`` their first index
        if isinstance(w, list):
            groups[i] = 4 + len(extra)
            extra += w
            weights[i] = w[0]
    weights += extra
    return (a, norms, weights, scales, kinds, groups, rot.cos, rot.sin, attn.num_heads, attn.num_kv_heads,
            attn.head_dim, rot.rot_dim, float(a.scale), mlp.gate_up_proj.out_features // 2,
            float(layer.input_layernorm.eps), _max_rows(lins))


def llama_decode_layer(layer, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                       md) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``LlamaDecoderLayer.forward`` for a decode-only step as one op: ``(mlp output, residual)``, x and residual
    updated in place as the Python path's fused norms do. ``layer`` is the ``LlamaDecoderLayer``, ``md`` the step's
    metadata."""
    const = layer.__dict__.get("_decode_block_weights", False)
    if const is False:
        const = layer.__dict__["_decode_block_weights"] = _llama_layer_weights(layer)
    ops = cpu_ops.get_ops()
    if ops is None or const is None:
        return None
    (a, norms, weights, scales, kinds, groups, cos, sin, heads, kv_heads, head_dim, rot_dim, scale, inter, eps,
     max_rows) = const
    if (x.shape[0] >= max_rows or a.k_cache is None or a.k_cache.dtype != x.dtype or x.dim() != 2
            or not x.is_contiguous() or norms[0].dtype != x.dtype
            or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                          or not residual.is_contiguous()))):
        return None
    tables = md.group(a.kv_group)
    out = ops.llama_decode_layer(
        x, residual, norms[0], weights, scales, kinds, groups, positions, cos, sin, a.k_cache, a.v_cache,
        tables.slot_mapping, tables.decode_block_tables, md.decode_seq_lens, heads, kv_heads, head_dim, rot_dim,
        scale, norms[1], inter, eps)
    return out, (x if residual is None else residual)


def _llama_stack_weights(layers) -> tuple | None:
    """The stack op's constants for these layers (their per-layer constants flattened), or None when a layer's weights
    do not fit the block or the layers differ in what the op takes once for all (shapes, rotary tables, eps, KV
    group). Built once, at the first decode step."""
    consts = []
    for layer in layers:
        const = layer.__dict__.get("_decode_block_weights", False)
        if const is False:
            const = layer.__dict__["_decode_block_weights"] = _llama_layer_weights(layer)
        if const is None:
            return None
        consts.append(const)
    shared = [(c[0].kv_group, c[6], c[7], *c[8:15]) for c in consts]  # kv group, cos, sin, shapes, scale, eps
    if any(s[0] != shared[0][0] or s[1] is not shared[0][1] or s[2] is not shared[0][2] or s[3:] != shared[0][3:]
           for s in shared):
        return None
    weights, scales, kinds, groups, offsets, norms = [], [], [], [], [0], []
    for a, layer_norms, w, s, k, g, *_ in consts:
        weights += w
        scales += s
        kinds += k
        groups += g
        offsets.append(len(weights))
        norms += layer_norms
    return (consts, weights, scales, kinds, groups, offsets, norms, min(c[15] for c in consts))


def llama_decode_stack(model, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``LlamaModel``'s loop over its decoder layers for a decode-only step as one op (``llama_decode_layers``: each
    layer's ``llama_decode_layer`` in order, the same bits): ``(last layer's output, residual)``; None where a layer
    would not take its block, or a layer has forward hooks (they see each layer's call: the per-layer path)."""
    layers = model.layers
    if not layers or not all(layer._block_ok for layer in layers):
        return None
    md = decode_only_step(x)
    ops = cpu_ops.get_ops()
    if md is None or ops is None or any(layer._forward_hooks or layer._forward_pre_hooks for layer in layers):
        return None
    const = model.__dict__.get("_decode_stack_weights", False)
    if const is False:
        const = model.__dict__["_decode_stack_weights"] = _llama_stack_weights(layers)
    if const is None:
        return None
    consts, weights, scales, kinds, groups, offsets, norms, max_rows = const
    a0, (n0, _), _, _, _, _, cos, sin, heads, kv_heads, head_dim, rot_dim, scale, inter, eps, _ = consts[0]
    caches = [c for cst in consts for c in (cst[0].k_cache, cst[0].v_cache)]
    if (x.shape[0] >= max_rows or any(c is None or c.dtype != x.dtype for c in caches) or x.dim() != 2
            or not x.is_contiguous() or n0.dtype != x.dtype):
        return None
    tables = md.group(a0.kv_group)
    return ops.llama_decode_layers(
        x, weights, scales, kinds, groups, offsets, norms, caches, positions, cos, sin, tables.slot_mapping,
        tables.decode_block_tables, md.decode_seq_lens, heads, kv_heads, head_dim, rot_dim, scale, inter, eps)
