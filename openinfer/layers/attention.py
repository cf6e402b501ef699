"""Attention over the paged KV cache for mixed batches (decodes and prefill chunks in one step).

Two backends share the cache layout ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer:
- ``reference``: per sequence, per query, explicit fp32 softmax over keys gathered slot by slot — slow and
  obviously right; the fast path is tested against it.
- ``sdpa``: all decodes in one padded batched ``scaled_dot_product_attention`` over gathered blocks; each
  prefill chunk one causal SDPA (directly on the fresh K/V when nothing precedes it in the cache). On CPU the
  decodes go to a C++ kernel (``cpu_ops.paged_decode_attention``) that reads the paged cache in place; the
  gather + SDPA path remains for GPUs and for when the kernel is off or could not be built.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.config import AttentionBackend
from openinfer.forward_context import AttentionMetadata, KVGroupTables, get_forward_context
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.layers import cpu_ops
from openinfer.layers.kv_quant import as_cached, is_fp8, write_rows
from openinfer.platform import cpu_has_fast_bf16

# The one KV group of a model whose layers all attend over the whole sequence.
FULL_ATTENTION_GROUP = "full"


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: AttentionBackend = AttentionBackend.SDPA, kv_group: str = FULL_ATTENTION_GROUP) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads="
                             f"{num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.kv_group = kv_group  # the KV group (kv_cache_spec) whose blocks hold this layer's K/V
        # Bound by the model's bind_kv_cache.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cached: bool = False) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D]. Returns [T, Hq*D]. ``kv_cached``: the caller already wrote k and v
        into this layer's cache at the step's slots (a fused rotary + cache-write kernel)."""
        md = get_forward_context()
        tables = md.group(self.kv_group)
        if self.k_cache is None:
            raise RuntimeError("attention layer has no KV cache bound")
        if not kv_cached:
            kc = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
            vc = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
            write_rows(kc, tables.slot_mapping, k)
            write_rows(vc, tables.slot_mapping, v)
        if self.backend == AttentionBackend.REFERENCE:
            out = reference_paged_attention(q, md, tables, self.k_cache, self.v_cache, self.scale)
        else:
            out = self._sdpa(q, k, v, md, tables)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def bind_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def free_cache(self) -> None:
        self.k_cache = self.v_cache = None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
              tables: KVGroupTables) -> torch.Tensor:
        out = torch.empty_like(q)
        if md.prefills:  # fresh chunks attend over their K/V as the cache holds them (kv_quant.as_cached)
            k, v = as_cached(k, self.k_cache.dtype), as_cached(v, self.v_cache.dtype)
        gqa = self.num_heads != self.num_kv_heads
        nd = md.num_decodes
        # On CPU the C++ kernel reads K/V straight from the paged cache into out[:nd]; it returns None where
        # it is unavailable (GPU tensors, OPENINFER_CPU_KERNELS=0, no compiler): then gather + SDPA runs.
        if nd and cpu_ops.paged_decode_attention(q[:nd], self.k_cache, self.v_cache, tables.decode_block_tables,
                                                 md.decode_seq_lens, self.scale, out=out[:nd]) is None:
            out[:nd] = self._decode_gather_sdpa(q[:nd], md, tables)
        for s, g, n in _fresh_prefill_runs(md.prefills):
            # g back-to-back chunks of n tokens with nothing cached before them: one causal SDPA over
            # [g, H, n, D] views of the fresh q/k/v (a call per chunk cost ~0.25 ms each at n=128: 512 calls
            # for a 32 x 128-token prefill of a 16-layer model).
            e = s + g * n
            qs, ks, vs = (x[s:e].view(g, n, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=gqa)
            out[s:e] = o.transpose(1, 2).reshape(e - s, *out.shape[1:])
        for span in md.prefills:  # chunks after cached tokens: their keys come from the cache
            s, n = span.query_start, span.query_len
            if span.context_len == n:
                continue
            qs = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            ks, vs = _gather(self.k_cache, self.v_cache, tables.table(span), span.context_len)
            ks = ks.transpose(0, 1).unsqueeze(0).to(q.dtype)
            vs = vs.transpose(0, 1).unsqueeze(0).to(q.dtype)
            # Query i sits at absolute position context_len - n + i and sees keys 0..that position.
            q_pos = torch.arange(span.context_len - n, span.context_len, device=q.device)
            k_pos = torch.arange(span.context_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
            out[s:s + n] = o.squeeze(0).transpose(0, 1)
        return out

    def _decode_gather_sdpa(self, qd: torch.Tensor, md: AttentionMetadata, tables: KVGroupTables) -> torch.Tensor:
        """Decodes as one padded batched SDPA: each sequence's blocks gathered into [B, Hk, L, D], the padding
        masked. The GPU path, and the CPU one when the C++ kernel is unavailable."""
        nd = qd.shape[0]
        shape = (nd, -1, self.num_kv_heads, self.head_dim)
        dt = _decode_dtype(qd)
        kd = _gather_blocks(self.k_cache, tables.decode_block_tables).view(shape).transpose(1, 2).to(dt)
        vd = _gather_blocks(self.v_cache, tables.decode_block_tables).view(shape).transpose(1, 2).to(dt)
        if is_fp8(self.k_cache.dtype):
            # The gathered blocks' slots past each sequence's length are stale: in e4m3 they may hold NaN (a NaN
            # once written stays), and NaN * a masked-out weight of 0 is still NaN. Zero them.
            valid = md.decode_mask.view(nd, 1, -1, 1)
            kd, vd = kd.masked_fill(~valid, 0), vd.masked_fill(~valid, 0)
        od = F.scaled_dot_product_attention(qd.unsqueeze(2).to(dt), kd, vd, attn_mask=md.decode_bias(dt),
                                            scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return od.squeeze(2).to(qd.dtype)


def _fresh_prefill_runs(prefills) -> list[tuple[int, int, int]]:
    """(first token, chunk count, chunk length) for each run of adjacent prefill chunks that have nothing
    cached before them (context_len == query_len) and share one length."""
    runs: list[list[int]] = []
    for span in prefills:
        if span.context_len != span.query_len:
            continue
        last = runs[-1] if runs else None
        if last is not None and last[2] == span.query_len and last[0] + last[1] * last[2] == span.query_start:
            last[1] += 1
        else:
            runs.append([span.query_start, 1, span.query_len])
    return [tuple(r) for r in runs]


def _decode_dtype(q: torch.Tensor) -> torch.dtype:
    """Single-query attention on CPU is many tiny matmuls: without native bf16 (AVX2-only hosts) they ran
    ~2.5x faster in fp32 than in bf16; with AMX / AVX512-BF16, bf16 SDPA ran 2x faster than converting the
    gathered cache to fp32 (B=32, 150 tokens, 1 thread: 1.14 vs 2.25 ms per layer). GPUs keep the cache dtype."""
    if q.device.type == "cpu" and q.dtype != torch.float32 and not cpu_has_fast_bf16():
        return torch.float32
    return q.dtype


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Blocks ``block_table`` (any shape) of a ``[num_blocks, ...]`` cache, as ``[*block_table.shape, ...]``.
    ``index_select`` on the block-flattened view copies whole blocks; advanced indexing ``cache[table]`` on the
    4-D tensor measured 2.4x slower on CPU (bf16, 32 x 10 blocks of 16 x 4 x 64)."""
    flat = cache.view(cache.shape[0], -1).index_select(0, block_table.reshape(-1))
    return flat.view(*block_table.shape, *cache.shape[1:])


def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, length: int):
    hk, d = k_cache.shape[-2:]
    ks = _gather_blocks(k_cache, block_table).view(-1, hk, d)[:length]
    vs = _gather_blocks(v_cache, block_table).view(-1, hk, d)[:length]
    return ks, vs


def reference_paged_attention(q: torch.Tensor, md: AttentionMetadata, tables: KVGroupTables, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain fp32 attention, one sequence and one query at a time, reading keys slot by slot."""
    bs = md.block_size
    hq = q.shape[1]
    hk = k_cache.shape[2]
    group = hq // hk
    out = torch.empty_like(q)
    seqs: list[tuple[int, int, int, torch.Tensor]] = []
    for i in range(md.num_decodes):
        seqs.append((i, 1, int(md.decode_seq_lens[i]), tables.block_tables[i]))
    for span in md.prefills:
        seqs.append((span.query_start, span.query_len, span.context_len, tables.table(span)))
    for start, n, ctx, table in seqs:
        slots = [int(table[p // bs]) * bs + p % bs for p in range(ctx)]
        keys = k_cache.view(-1, hk, k_cache.shape[-1])[slots].float()  # [ctx, Hk, D]
        vals = v_cache.view(-1, hk, v_cache.shape[-1])[slots].float()
        for i in range(n):
            pos = ctx - n + i
            qi = q[start + i].float()  # [Hq, D]
            kk = keys[:pos + 1].repeat_interleave(group, dim=1)  # [L, Hq, D]
            vv = vals[:pos + 1].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", qi, kk) * scale
            probs = torch.softmax(scores, dim=-1)
            out[start + i] = torch.einsum("hl,lhd->hd", probs, vv).to(q.dtype)
    return out


def paged_attention_spec(layers: list[Attention], block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
    """The one whole-life group of models whose layers all attend over the full sequence: K and V per layer."""
    return [KVGroupSpec(FULL_ATTENTION_GROUP, block_size * sum(a.kv_bytes_per_token(dtype) for a in layers))]


def bind_layer_caches(layers, num_blocks, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Each layer allocates its own stores in the blocks of the group it reads (``layer.kv_group``)."""
    for layer in layers:
        layer.bind_cache(num_blocks[layer.kv_group], block_size, dtype, device)


def free_layer_caches(layers) -> None:
    for layer in layers:
        layer.free_cache()
