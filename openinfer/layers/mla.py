"""Multi-head latent attention (DeepSeek-V2/V3) over a paged *latent* cache.

The cache holds, per token and per layer, one ``[c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]`` vector
shared by all heads: layout ``[num_blocks, block_size, kv_lora_rank + rope]`` (576 values/token for V3 instead
of 128 heads x 2 x 128 for plain MHA). With ``kv_b_proj`` split per head into W_UK [Dn, L] and W_UV [Dv, L]:
  k_h = [W_UK_h c_kv | k_pe],  v_h = W_UV_h c_kv.
Backends:
- ``sdpa`` (fast): decodes use the weight-absorbed form — q'_h = W_UK_h^T q_nope_h, so scores are
  q'_h . c_kv + q_pe_h . k_pe and out_h = W_UV_h (p_h @ c_kv) — one MQA over the latent with no per-token
  decompression, on CPU the C++ kernel over the cache blocks in place (torch fallback: gather + SDPA). Prefill
  chunks decompress K/V per sequence (on kv_b's panels on CPU) and run causal MHA: with many queries per key that
  is fewer FLOPs (head dim 192+128 instead of 576+512 for V3) and the decompression is amortised. fp32 on CPU runs
  the causal C++ kernel (cpu_kernels/mla_prefill.cpp: k_pe read in place, no padding); otherwise SDPA, with V
  zero-padded to the q/k head dim because its fused (flash) CPU kernel takes only one head dim and otherwise falls
  back to its math path.
- ``reference``: per sequence and per query, fp32, keys read slot by slot and decompressed: plainly correct.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.config import AttentionBackend
from openinfer.forward_context import AttentionMetadata, KVGroupTables, get_forward_context
from openinfer.layers import cpu_ops, dispatch
from openinfer.layers.kv_quant import as_cached, is_fp8, write_rows
from openinfer.layers.attention import FULL_ATTENTION_GROUP


class MLAAttention(nn.Module):
    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float, backend: AttentionBackend = AttentionBackend.SDPA,
                 kv_group: str = FULL_ATTENTION_GROUP) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale
        self.backend = backend
        self.kv_group = kv_group
        # [num_blocks, block_size, kv_lora_rank + rope]; bound by the model's bind_kv_cache.
        self.kv_cache: torch.Tensor | None = None
        # (kv_b weight, its version, W_UK^T panels, W_UV panels, kv_b panels): see _absorbed_panels
        self._absorbed: tuple | None = None
        # (kv_b weight, its version, W_UK [H, Dn, L], W_UV^T [H, L, Dv], both contiguous): see _absorbed_dense
        self._absorbed_bmm: tuple | None = None
        # (kv_b weight, its version, W_UK^T and W_UV in pair panels): see _absorbed_pairs
        self._absorbed_pair: tuple | None = None

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                kv_b_weight: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, Dn], q_pe [T, H, R] (rotated), c_kv [T, L] (normed), k_pe [T, R] (rotated),
        kv_b_weight [H*(Dn+Dv), L] -> [T, H*Dv]. Writes this step's latents into the cache first."""
        md = get_forward_context()
        tables = md.group(self.kv_group)
        if self.kv_cache is None:
            raise RuntimeError("MLA layer has no latent KV cache bound")
        latent = torch.cat((c_kv, k_pe), dim=-1)
        flat = self.kv_cache.view(-1, self.latent_dim)
        write_rows(flat, tables.slot_mapping, latent)
        if self.backend == AttentionBackend.REFERENCE:
            out = reference_mla(q_nope, q_pe, md, tables, self.kv_cache, kv_b_weight, self.kv_lora_rank,
                                self.scale)
        else:
            out = self._fast(q_nope, q_pe, latent, kv_b_weight, md, tables)
        return out.reshape(q_nope.shape[0], self.num_heads * self.v_head_dim)

    def _split_kv_b(self, kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]  # W_UK [H,Dn,L], W_UV [H,Dv,L]

    def _derived(self, slot: str, kv_b_weight: torch.Tensor, make) -> tuple:
        """``make(kv_b)``'s tensors, kept in attribute ``slot`` as (kv_b weight, its version, *tensors) and built
        again whenever kv_b's weight changes (another tensor, or written in place: a stale copy would keep the old
        weights)."""
        cached = getattr(self, slot)
        if cached is None or cached[0] is not kv_b_weight or cached[1] != kv_b_weight._version:
            with torch.no_grad():
                cached = (kv_b_weight, kv_b_weight._version, *make(kv_b_weight.detach()))
            setattr(self, slot, cached)
        return cached[2:]

    def _absorbed_panels(self, kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where ``cpu_ops.panels_enabled`` (CPU fp32, bf16 without native bf16): W_UK^T and W_UV per head in the panel
        layout (``cpu_ops.pack_panels``) for the two absorbed decode GEMMs, and kv_b whole for the prefill
        decompression. Two more copies of kv_b's bytes. torch.bmm on strided views of kv_b read them at ~half the copy
        bandwidth at batch 1 (1.6 ms of a 14 ms V3 bench decode step); aten::mm packs kv_b afresh on every call, so a
        128-token prefill span's decompression ran at ~37 GFLOP/s (~20 % of a V3 bench prefill)."""
        if not cpu_ops.panels_enabled(kv_b_weight.device, kv_b_weight.dtype):
            return None

        def make(w):
            w_uk, w_uv = self._split_kv_b(w)
            return cpu_ops.pack_panels(w_uk.transpose(1, 2)), cpu_ops.pack_panels(w_uv), cpu_ops.pack_panels(w)
        return self._derived("_absorbed", kv_b_weight, make)

    def _absorbed_pairs(self, kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where ``KernelSelection.mla_pair_panels`` (bf16 on a native-bf16 CPU whose build has AVX512-BF16): W_UK^T
        [H, L, Dn] and W_UV [H, Dv, L] in pair panels (``cpu_ops.pack_pair_panels``) for the two absorbed decode
        GEMMs on vdpbf16ps. torch.bmm (oneDNN) ran these per-head GEMMs of 1-32 rows far under the copy bandwidth
        (docs/results/moe_bf16_avx512). Two more copies of kv_b's bytes, as the panels."""
        if not dispatch.active().mla_pair_panels(kv_b_weight.device, kv_b_weight.dtype):
            return None

        def make(w):
            w_uk, w_uv = self._split_kv_b(w)
            return cpu_ops.pack_pair_panels(w_uk.transpose(1, 2)), cpu_ops.pack_pair_panels(w_uv)
        return self._derived("_absorbed_pair", kv_b_weight, make)

    def _absorbed_dense(self, kv_b_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, Dn, L] and W_UV^T [H, L, Dv] for the absorbed decode's two torch.bmm calls where there are no
        panels. On CPU (native bf16: oneDNN's GEMMs) they are contiguous copies: given the strided views of kv_b,
        bmm copied them to a contiguous layout on every call (W_UV^T a transposing copy, ~0.4 ms a layer for a
        12-head, 512-rank layer on a Zen 4, 12 % of a batch-8 decode step of issue 38's DeepSeek-V3 shape). In bf16
        the same bits (oneDNN copied the views to this layout); fp32 bmm may block the two layouts differently
        (summation order only). Two more copies of kv_b's bytes, as the panels. Elsewhere the views as they are
        (cuBLAS takes the strides)."""
        if kv_b_weight.device.type != "cpu":
            w_uk, w_uv = self._split_kv_b(kv_b_weight)
            return w_uk, w_uv.transpose(1, 2)

        def make(w):
            w_uk, w_uv = self._split_kv_b(w)
            return w_uk.contiguous(), w_uv.transpose(1, 2).contiguous()
        return self._derived("_absorbed_bmm", kv_b_weight, make)

    def _absorbed_weights(self, kv_b_weight: torch.Tensor) -> tuple:
        """(gemm, (W_UK side, W_UV side)) for this step's two absorbed GEMMs, chosen once per call of ``_fast``:
        the panels where the selection keeps them, else the pair panels, else (None, the bmm layouts)."""
        panels = self._absorbed_panels(kv_b_weight)
        if panels is not None:
            return cpu_ops.panel_gemm, panels[:2]
        pairs = self._absorbed_pairs(kv_b_weight)
        if pairs is not None:
            return cpu_ops.pair_panel_gemm, pairs
        return None, self._absorbed_dense(kv_b_weight)

    def _absorbed_gemm(self, weights: tuple, which: int, x_hm: torch.Tensor, kv_b_weight: torch.Tensor, n: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """x_hm [H, B, K] times W_UK (which 0: K = Dn -> [H, B, L]) or W_UV^T (1: K = L -> [H, B, Dv]) per head, on
        ``weights`` (``_absorbed_weights``), into ``out`` (a [H, B, n] view) when given; torch.bmm where the kernel
        cannot take the call."""
        gemm, ws = weights
        y = None if gemm is None else gemm(x_hm, ws[which], n, out=out)
        if y is not None:
            return y
        y = torch.bmm(x_hm, (ws if gemm is None else self._absorbed_dense(kv_b_weight))[which])
        return y if out is None else out.copy_(y)

    def _decompress(self, c_kv: torch.Tensor, kv_b_weight: torch.Tensor) -> torch.Tensor:
        """c_kv [S, L] @ kv_b^T -> [S, H * (Dn + Dv)], on kv_b's panels where there are any."""
        panels = self._absorbed_panels(kv_b_weight)
        kv = None if panels is None else cpu_ops.panel_gemm(c_kv, panels[2], kv_b_weight.shape[0])
        return c_kv @ kv_b_weight.t() if kv is None else kv

    def bind_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.kv_cache = torch.zeros(num_blocks, block_size, self.latent_dim, dtype=dtype, device=device)

    def free_cache(self) -> None:
        self.kv_cache = None

    def _fast(self, q_nope, q_pe, latent, kv_b_weight, md: AttentionMetadata, tables: KVGroupTables) -> torch.Tensor:
        h, lr, dv = self.num_heads, self.kv_lora_rank, self.v_head_dim
        out = q_nope.new_empty(q_nope.shape[0], h, dv)
        nd = md.num_decodes
        if nd:
            # Head-major throughout: W_UK and W_UV are applied as one batched GEMM over the heads each
            # ([H, B, Dn] @ [H, Dn, L], [H, B, L] @ [H, L, Dv]: _absorbed_gemm), and the attention reads q and
            # writes o through [B, H, .] views of head-major buffers, so no permuted copy is made on the way in or
            # out (einsum made one of q and o per call).
            weights = self._absorbed_weights(kv_b_weight)
            q_lat = self._absorbed_gemm(weights, 0, q_nope[:nd].transpose(0, 1), kv_b_weight, lr)
            q = torch.cat((q_lat, q_pe[:nd].transpose(0, 1)), dim=-1).transpose(0, 1)  # [B, H, L+R] view
            # The C++ kernel reads each sequence's latent rows in place (cpu_kernels/mla_decode.cpp); the torch
            # path below gathers them into a tensor padded to the longest sequence.
            o_hm = q.new_empty(h, nd, lr)
            o = cpu_ops.mla_decode_attention(q, self.kv_cache, tables.decode_block_tables, md.decode_seq_lens,
                                             self.scale, lr, out=o_hm.transpose(0, 1))
            if o is None:
                kv = self.kv_cache[tables.decode_block_tables].view(nd, 1, -1, self.latent_dim).to(q.dtype)
                if is_fp8(self.kv_cache.dtype):  # stale e4m3 slots may hold NaN, which a 0 weight keeps: zero them
                    kv = kv.masked_fill(~md.decode_mask.view(nd, 1, -1, 1), 0)
                o = F.scaled_dot_product_attention(q.unsqueeze(2), kv, kv[..., :lr], attn_mask=md.decode_mask,
                                                   scale=self.scale, enable_gqa=True).squeeze(2)  # [B, H, L]
                o_hm = o.transpose(0, 1)
            self._absorbed_gemm(weights, 1, o_hm, kv_b_weight, dv, out=out[:nd].transpose(0, 1))
        for span in md.prefills:
            s, n, ctx = span.query_start, span.query_len, span.context_len
            if ctx == n:  # nothing cached before this chunk: use the fresh latents (as cached), skip the gather
                lat = as_cached(latent[s:s + n], self.kv_cache.dtype)
            else:
                lat = self.kv_cache[tables.table(span)].view(-1, self.latent_dim)[:ctx].to(q_nope.dtype)
            kv = self._decompress(lat[:, :lr], kv_b_weight)  # [ctx, H * (Dn + Dv)]
            if cpu_ops.mla_prefill_attention(out[s:s + n], q_nope[s:s + n], q_pe[s:s + n], kv, lat[:, lr:],
                                             self.scale):
                continue
            k, v = split_kv(kv, lat[:, lr:], h, self.qk_nope_head_dim)
            q = torch.cat((q_nope[s:s + n], q_pe[s:s + n]), dim=-1).transpose(0, 1).unsqueeze(0)
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            dqk = q.shape[-1]
            if dv < dqk:  # SDPA's fused CPU kernel needs one head dim for q, k and v: zero value columns
                v = F.pad(v, (0, dqk - dv))
            if ctx == n:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            else:
                # Query i sits at absolute position ctx - n + i and sees keys 0..that position.
                q_pos = torch.arange(ctx - n, ctx, device=q.device)
                mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            out[s:s + n] = o.squeeze(0).transpose(0, 1)[..., :dv]
        return out


def decompress(latent: torch.Tensor, kv_b_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int,
               kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [S, L+R] -> K [S, H, Dn+R], V [S, H, Dv] (k_pe shared by every head)."""
    return split_kv(latent[:, :kv_lora_rank] @ kv_b_weight.t(), latent[:, kv_lora_rank:], num_heads,
                    qk_nope_head_dim)


def split_kv(kv: torch.Tensor, k_pe: torch.Tensor, num_heads: int,
             qk_nope_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [S, H*(Dn+Dv)] (c_kv @ kv_b^T), k_pe [S, R] -> K [S, H, Dn+R], V [S, H, Dv]."""
    s = kv.shape[0]
    kv = kv.view(s, num_heads, -1)
    k_nope, v = kv[..., :qk_nope_head_dim], kv[..., qk_nope_head_dim:]
    k = torch.cat((k_nope, k_pe[:, None, :].expand(s, num_heads, k_pe.shape[-1])), dim=-1)
    return k, v


def reference_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, md: AttentionMetadata, tables: KVGroupTables,
                  kv_cache: torch.Tensor, kv_b_weight: torch.Tensor, kv_lora_rank: int, scale: float) -> torch.Tensor:
    """Plain fp32 MHA, one sequence and one query at a time, on K/V decompressed from latents read slot
    by slot."""
    bs = md.block_size
    h, dn = q_nope.shape[1], q_nope.shape[2]
    out = q_nope.new_empty(q_nope.shape[0], h, kv_b_weight.shape[0] // h - dn)
    seqs: list[tuple[int, int, int, torch.Tensor]] = []
    for i in range(md.num_decodes):
        seqs.append((i, 1, int(md.decode_seq_lens[i]), tables.block_tables[i]))
    for span in md.prefills:
        seqs.append((span.query_start, span.query_len, span.context_len, tables.table(span)))
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    for start, n, ctx, table in seqs:
        slots = [int(table[p // bs]) * bs + p % bs for p in range(ctx)]
        keys, vals = decompress(flat[slots].float(), kv_b_weight.float(), h, dn, kv_lora_rank)
        for i in range(n):
            pos = ctx - n + i
            qi = torch.cat((q_nope[start + i], q_pe[start + i]), dim=-1).float()  # [H, Dn+R]
            scores = torch.einsum("hd,lhd->hl", qi, keys[:pos + 1]) * scale
            out[start + i] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), vals[:pos + 1])
    return out
