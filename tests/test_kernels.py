"""Fast paths against their plain torch references: paged attention (SDPA) and grouped MoE."""
from __future__ import annotations

import pytest
import torch

from openinfer.executor.forward_context import AttentionMetadata, PrefillSpan, set_forward_context
from openinfer.layers.attention import Attention
from openinfer.layers.moe import fused_experts, reference_experts


def build_batch(decode_lens, prefills, bs, hk, d, num_blocks, dtype, gen):
    """Random paged cache plus a mixed batch: decodes (1 query, context len L) then prefill chunks
    (query_len, context_len). Blocks are handed out in a shuffled order so tables are not contiguous."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for ctx in list(decode_lens) + [c for _, c in prefills]:
        nb = -(-ctx // bs)
        tables.append(torch.tensor([perm.pop() for _ in range(nb)]))
    kc = torch.randn(num_blocks, bs, hk, d, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, bs, hk, d, generator=gen).to(dtype)
    nd = len(decode_lens)
    spans = []
    for i, ctx in enumerate(decode_lens):
        p = ctx - 1
        slots.append(int(tables[i][p // bs]) * bs + p % bs)
    off = nd
    for j, (q, ctx) in enumerate(prefills):
        t = tables[nd + j]
        for p in range(ctx - q, ctx):
            slots.append(int(t[p // bs]) * bs + p % bs)
        spans.append(PrefillSpan(off, q, ctx, t))
        off += q
    dbt = dlens = dmask = None
    if nd:
        mb = max(len(t) for t in tables[:nd])
        dbt = torch.stack([torch.cat([t, t.new_zeros(mb - len(t))]) for t in tables[:nd]])
        dlens = torch.tensor(decode_lens)
        dmask = (torch.arange(mb * bs)[None] < dlens[:, None])[:, None, None, :]
    md = AttentionMetadata(off, bs, torch.tensor(slots), nd, dbt, dlens, dmask, spans)
    return md, kc, vc


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("hq, hk", [(4, 4), (8, 2)])
def test_sdpa_paged_attention_matches_reference(dtype, tol, hq, hk):
    gen = torch.Generator().manual_seed(0)
    bs, d = 16, 32
    md, kc, vc = build_batch([1, 17, 40, 64], [(5, 5), (7, 30), (16, 16), (3, 50)], bs, hk, d, 64, dtype, gen)
    t = md.num_tokens
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hk, d, generator=gen).to(dtype)
    v = torch.randn(t, hk, d, generator=gen).to(dtype)
    outs = []
    for backend in ("sdpa", "reference"):
        attn = Attention(hq, hk, d, d ** -0.5)
        attn.backend = backend
        attn.k_cache, attn.v_cache = kc.clone(), vc.clone()
        with set_forward_context(md):
            outs.append(attn(q, k, v).float())
    assert (outs[0] - outs[1]).abs().max() < tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_grouped_moe_matches_reference(dtype, tol, limit):
    gen = torch.Generator().manual_seed(1)
    t, h, i, e, k = 45, 64, 32, 8, 3
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.1).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[:5] = 2  # an expert with many rows and (below) experts with none
    ids[:5, 1], ids[:5, 2] = 3, 4
    w = torch.rand(t, k, generator=gen)
    got = fused_experts(x, w13, w2, w, ids, limit).float()
    ref = reference_experts(x, w13, w2, w, ids, limit).float()
    assert (got - ref).abs().max() < tol * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("m", [1, 3, 64, 600])
@pytest.mark.parametrize("bias", [True, False])
def test_row_blocked_linear_equals_plain(m, bias):
    from openinfer.layers.linear import Linear

    torch.manual_seed(0)
    layer = Linear(96, 1500, bias=bias)  # 1500 rows: 3 blocks of 512 (last one short)
    x = torch.randn(m, 96)
    assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)
