"""Plain whole-sequence reference of DeepSeek-V4.1 (no cache: every call recomputes the whole sequence), written
from DeepInfer's definitions (spec §7) to test the paged engine path against. Slow by design: Python loops over
windows, queries and entries, explicit softmaxes, Python ``sorted`` for every top-k (ties -> lowest index),
numpy for the Engram hashes. It shares the model's parameters and its plain projections (linears, norms, RoPE
tables), not its compression, sharing, indexer, candidate, YOCO, mHC or Engram code.
``numerics`` (cache.KVNumerics, DeepInfer's KV formats): every value the engine would store in a packed store -
window kv, roped entries, index keys - and the indexer's queries go through the format's write and read
(``MxFormat.round_trip``) where they are made, as if stored and read back.
"""
from __future__ import annotations

import numpy as np
import torch

from openinfer.layers.rotary import apply_interleaved
from openinfer.models.deepseek_v4.hc import sinkhorn


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


def mixes(hc, X: torch.Tensor):
    """-> pre [T, n], post [T, n], comb [T, n, n] for streams X [T, n, D]."""
    n = hc.hc_mult
    m = _rms(X.reshape(X.shape[0], -1), None, hc.norm_eps) @ hc.fn.float().t()
    s, b = hc.scale.float(), hc.base.float()
    pre = torch.sigmoid(m[:, :n] * s[0] + b[:n]) + hc.hc_eps
    post = 2 * torch.sigmoid(m[:, n:2 * n] * s[1] + b[n:2 * n])
    comb = sinkhorn((m[:, 2 * n:] * s[2] + b[2 * n:]).view(-1, n, n), hc.sinkhorn_iters, hc.hc_eps)
    return pre, post, comb


def post_mix(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(X, dtype=torch.float32)
    for k in range(X.shape[1]):
        out[:, k] = post[:, k, None] * y.float() + sum(comb[:, j, k, None] * X[:, j].float() for j in range(X.shape[1]))
    return out.to(X.dtype)


def engram_hashes(engram, ids: list[int], pad: int) -> np.ndarray:
    """[T, (N-1)*H] table rows, numpy int64 (wrapping) arithmetic as DeepSeek's Engram demo."""
    x = np.asarray(ids, dtype=np.int64)[None]
    if engram.lookup is not None:  # tokenizer compression, the pad id too
        x, pad = engram.lookup.numpy()[x], int(engram.lookup[pad])
    n_max = engram.max_ngram_size
    mult = engram.mult.numpy()
    shifts = [x] + [np.pad(x, ((0, 0), (k, 0)), constant_values=pad)[:, :x.shape[1]] for k in range(1, n_max)]
    sizes, offsets = engram.sizes.tolist(), engram.offsets.tolist()
    out, col = [], 0
    with np.errstate(over="ignore"):
        for n in range(2, n_max + 1):
            mix = shifts[0] * mult[0]
            for k in range(1, n):
                mix = np.bitwise_xor(mix, shifts[k] * mult[k])
            for _ in range(engram.n_heads):
                out.append(mix % sizes[col] + offsets[col])
                col += 1
    return np.stack(out, axis=2)[0]


def engram_gate(engram, X: torch.Tensor, ids: list[int], pad: int) -> torch.Tensor:
    rows = torch.from_numpy(engram_hashes(engram, ids, pad))
    e = engram.embed.weight[rows].flatten(1)
    kv = engram.kv_proj(e.to(X.dtype)).float()
    d = engram.hidden_size
    out = X.float().clone()
    for j in range(engram.hc_mult):
        q = _rms(X[:, j], engram.q_weight[j], engram.eps)
        k = _rms(kv[:, j * d:(j + 1) * d], engram.k_weight[j], engram.eps)
        g = (q * k).sum(-1) / d ** 0.5
        g = torch.sigmoid(torch.sign(g) * torch.sqrt(torch.clamp(g.abs(), min=1e-6)))
        out[:, j] += g[:, None] * kv[:, engram.hc_mult * d:]
    return out.to(X.dtype)


def compress(comp, h: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE entries [T // m, d] of the whole sequence."""
    m, out = comp.ratio, []
    for w in range(h.shape[0] // m):
        toks = h[w * m:(w + 1) * m]
        kv = comp.kv_proj(toks).float()
        if m == 1:
            latent = kv[0]
        else:
            gate = comp.gate_proj(toks).float()
            p = torch.exp(gate - gate.max(dim=0).values)
            latent = (kv * p / p.sum(dim=0)).sum(dim=0)
        out.append(_rms(latent.to(h.dtype), comp.kv_norm.weight, comp.kv_norm.eps))
    return torch.stack(out).to(h.dtype) if out else h.new_zeros(0, comp.dim)


class _Sequence:
    """Values a source layer computes for the whole sequence and later layers read."""

    def __init__(self, numerics=None) -> None:
        self.numerics = numerics
        self.entries: dict[int, torch.Tensor] = {}  # kv source -> pre-RoPE entries
        self.keys: dict[int, torch.Tensor] = {}  # index-K source -> roped index keys
        self.chosen: dict[int, list[list[int]]] = {}  # index source -> per query chosen entries
        self.candidates: list[set[int]] | None = None
        self.shared_hidden: torch.Tensor | None = None


def attention(model, i: int, h: torch.Tensor, seq: _Sequence) -> torch.Tensor:
    cfg = model.config
    a = model.model.layers[i].self_attn
    t_len = h.shape[0]
    pos = torch.arange(t_len)
    rot = model.model.rotary[a.rope_name]
    cos, sin = rot._compute(pos)
    q, q_res, kv = a.project(h, cos, sin)
    kv = _stored(seq, "kv", kv)
    m = a.ratio
    if m and a.compressor is not None:
        src_h = seq.shared_hidden if a.yoco_consumer else h
        seq.entries[i] = compress(a.compressor, src_h)
    if m and a.indexer is not None and a.indexer.wk is not None:
        pre = seq.entries[a.kv_source]
        starts = torch.arange(pre.shape[0]) * m
        c, s = rot._compute(starts)
        k = _rms(a.indexer.wk(pre), a.indexer.k_norm.weight, a.indexer.k_norm.eps).to(h.dtype)
        seq.keys[i] = _stored(seq, "index_keys", apply_interleaved(k, c, s))
    if m and a.indexer is not None:
        seq.chosen[i] = _choose(model, i, q_res, h, cos, sin, seq)
    stored = None
    if m:
        pre = seq.entries[a.kv_source]
        c, s = rot._compute(torch.arange(pre.shape[0]) * m)
        stored = _stored(seq, "entries", apply_interleaved(pre, c, s))
    out = torch.empty_like(q)
    for t in range(t_len):
        keys = [kv[p] for p in range(max(0, t - cfg.sliding_window + 1), t + 1)]
        if m:
            keys += [stored[w] for w in seq.chosen[a.index_source][t]]
        k = torch.stack(keys).float()
        logits = (q[t].float() @ k.t()) * a.scale
        top = torch.maximum(logits.max(dim=-1).values, a.sinks.float())
        e = torch.exp(logits - top[:, None])
        probs = e / (e.sum(dim=-1) + torch.exp(a.sinks.float() - top))[:, None]
        out[t] = (probs @ k).to(q.dtype)
    return a.project_out(out, cos, sin)


def _stored(seq: _Sequence, store: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` as the engine reads it back from ``store`` under the sequence's numerics."""
    layout = None if seq.numerics is None else seq.numerics.layout(store)
    return x if layout is None else layout.round_trip(x)


def _choose(model, i: int, q_res, h, cos, sin, seq: _Sequence) -> list[list[int]]:
    cfg, topo = model.config, model.config.topology
    a = model.model.layers[i].self_attn
    idx, m = a.indexer, a.ratio
    keys = seq.keys[a.index_k_source].float()
    qi = _stored(seq, "index_keys", apply_interleaved(idx.q_b_proj(q_res).view(-1, idx.n_heads, idx.head_dim), cos,
                                                      sin)).float()
    hw = idx.weights_proj(h).float() * idx.n_heads ** -0.5
    chosen, cands = [], []
    bs = topo.candidate_block_size
    for t in range(h.shape[0]):
        visible = (t + 1) // m
        scores = [float((torch.relu(qi[t] @ keys[w]) * idx.head_dim ** -0.5 * hw[t]).sum()) for w in range(visible)]
        pool = range(visible)
        if topo.uses_candidates(i):
            pool = [w for w in pool if w // bs in seq.candidates[t]]
        chosen.append(sorted(pool, key=lambda w: (-scores[w], w))[:cfg.index_topk])
        if topo.candidate_source == i:
            cands.append(candidate_set(scores, visible, bs, topo.candidate_topk_blocks))
    if topo.candidate_source == i:
        seq.candidates = cands
    return chosen


def candidate_set(scores: list[float], visible: int, block_size: int, k: int) -> set[int]:
    """The k blocks with the highest max score among the first ``visible`` entries; the newest block always
    (DeepInfer's candidate_block_max scores it +inf)."""
    blocks: dict[int, float] = {}
    for w in range(visible):
        blocks[w // block_size] = max(blocks.get(w // block_size, float("-inf")), scores[w])
    if blocks:
        blocks[(visible - 1) // block_size] = float("inf")
    return set(sorted(blocks, key=lambda b: (-blocks[b], b))[:k])


@torch.no_grad()
def reference_logits(model, ids: list[int], features: list | None = None, numerics=None) -> torch.Tensor:
    """Logits [T, vocab] (fp32) of every position of ``ids``, recomputed from scratch. ``features``: appended
    with the DSpark target features (per target layer, the streams entering its attention, mean over streams).
    ``numerics``: DeepInfer's KV formats to apply (see the module docstring); None: none."""
    cfg, m = model.config, model.model
    n = cfg.hc_mult
    x = m.embed_tokens.weight[torch.tensor(ids)]
    X = x[:, None].repeat(1, n, 1)
    pre = torch.zeros(len(ids), n)
    pre[:, 0] = 1
    seq = _Sequence(numerics)
    for i, layer in enumerate(m.layers):
        if layer.engram is not None:
            X = engram_gate(layer.engram, X, ids, cfg.engram.pad_token_id)
        if features is not None and cfg.dspark is not None and i in cfg.dspark.target_layer_ids:
            features.append(X.float().mean(dim=1))
        for hc, norm, block in ((layer.attn_hc, layer.input_layernorm, "attn"),
                                (layer.ffn_hc, layer.post_attention_layernorm, "ffn")):
            nxt, post, comb = mixes(hc, X)
            h = _rms((pre[:, :, None] * X.float()).sum(1).to(X.dtype), norm.weight, norm.eps).to(X.dtype)
            if block == "attn":
                if i == cfg.topology.n_prefill_layer:
                    seq.shared_hidden = h
                y = attention(model, i, h, seq)
            else:
                y = layer.mlp(h)
            X, pre = post_mix(y, X, post, comb), nxt
    hidden = _rms((pre[:, :, None] * X.float()).sum(1).to(X.dtype), m.norm.weight, m.norm.eps).to(X.dtype)
    return model.compute_logits(hidden).float()
