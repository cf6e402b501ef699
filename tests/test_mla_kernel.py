"""The MLA decode kernel (cpu_kernels/mla_decode.cpp) against plain torch: the op itself on odd shapes, and the
MLA layer's decode path with the kernel on and off."""
from __future__ import annotations

import pytest
import torch

from openinfer.config import AttentionBackend
from openinfer.forward_context import AttentionMetadata, set_forward_context
from openinfer.layers import cpu_ops
from openinfer.layers.mla import MLAAttention, reference_mla


def _paged(lens, bs, d, dtype, gen, spare_blocks=3):
    """A cache whose blocks are handed out shuffled, every slot no sequence owns (past a length, unused
    blocks) set to NaN: a kernel that reads one leaks NaN into its output."""
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + spare_blocks
    cache = torch.full((num_blocks, bs, d), float("nan"))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(max(need), 1)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    for b, (n, nb) in enumerate(zip(lens, need)):
        blocks = [perm.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(blocks, dtype=torch.long)
        for p in range(n):
            cache[blocks[p // bs], p % bs] = torch.randn(d, generator=gen)
    return cache.to(dtype), tables, torch.tensor(lens, dtype=torch.long)


def _reference(q, cache, tables, lens, scale, dv):
    """Per sequence, fp32: gather the rows slot by slot, softmax, values = the rows' first dv entries."""
    bs = cache.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], dv)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        rows = torch.stack([cache[tables[b, p // bs], p % bs] for p in range(n)]).float()
        p = torch.softmax(q[b].float() @ rows.t() * scale, dim=-1)
        out[b] = p @ rows[:, :dv]
    return out


def _run(ops, q, cache, tables, lens, scale, dv):
    out = torch.empty(q.shape[0], q.shape[1], dv, dtype=q.dtype)
    ops.mla_decode_attention(out, q, cache, tables, lens, scale)
    return out


# (D, Dv): DeepSeek-V3's 512 + 64; a width that is no multiple of the 16-lane vectors (the test models' 32 + 8);
# 128 + 16 with a value dim that is a multiple of 16 but not of 64; 28 + 8, no multiple of the 8-lane vectors
# (AVX2 builds) either.
DIMS = [(576, 512), (40, 32), (144, 112), (36, 28)]
# empty, single-token, block-boundary (16, 17, 32), odd lengths
LENS = [[1], [0, 1, 16, 17], [5, 33, 100, 32, 15]]


@pytest.mark.parametrize("d, dv", DIMS)
@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("heads", [1, 8, 20])
@pytest.mark.parametrize("bs", [16, 5])
def test_mla_kernel_fp32_matches_reference(kernel_ops, d, dv, lens, heads, bs):
    gen = torch.Generator().manual_seed(len(lens) * 100 + heads + d)
    cache, tables, lens_t = _paged(lens, bs, d, torch.float32, gen)
    q = torch.randn(len(lens), heads, d, generator=gen)
    scale = d ** -0.5
    got = _run(kernel_ops, q, cache, tables, lens_t, scale, dv)
    want = _reference(q, cache, tables, lens_t, scale, dv)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lens", LENS)
def test_mla_kernel_bf16_cache_matches_reference(kernel_ops, amx, qdtype, lens):
    """bf16 latents (the vector kernel widens them; the AMX path also rounds q and the probabilities to bf16,
    as flash attention does) against the fp32 reference on the same bf16 values."""
    if kernel_ops.mla_decode_use_amx(amx) != amx and amx:
        kernel_ops.mla_decode_use_amx(True)
        pytest.skip("no AMX in this build / on this CPU")
    try:
        gen = torch.Generator().manual_seed(7 + len(lens))
        cache, tables, lens_t = _paged(lens, 16, 576, torch.bfloat16, gen)
        q = torch.randn(len(lens), 16, 576, generator=gen).to(qdtype)
        got = _run(kernel_ops, q, cache, tables, lens_t, 576 ** -0.5, 512).float()
        want = _reference(q, cache, tables, lens_t, 576 ** -0.5, 512)
    finally:
        kernel_ops.mla_decode_use_amx(True)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 if amx else 1e-2)


def test_mla_kernel_same_bits_for_any_thread_count(kernel_ops):
    """Heads are split into tasks by thread count; each head's arithmetic must not depend on the split."""
    gen = torch.Generator().manual_seed(3)
    cache, tables, lens = _paged([1, 40, 7], 16, 576, torch.float32, gen)
    q = torch.randn(3, 8, 576, generator=gen)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(_run(kernel_ops, q, cache, tables, lens, 0.05, 512))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_mla_kernel_rejects_bad_tables(kernel_ops):
    gen = torch.Generator().manual_seed(4)
    cache, tables, lens = _paged([20], 16, 40, torch.float32, gen)
    q = torch.randn(1, 2, 40, generator=gen)
    bad = tables.clone()
    bad[0, 1] = cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        _run(kernel_ops, q, cache, bad, lens, 0.1, 32)
    with pytest.raises(RuntimeError, match="needs 3 blocks"):
        _run(kernel_ops, q, cache, tables, torch.tensor([40]), 0.1, 32)


def test_mla_kernel_head_major_views_same_bits(kernel_ops):
    """The layer hands the kernel [B, H, .] views of head-major [H, B, .] buffers (q from the W_UK GEMM, o for
    the W_UV one): read and written through their strides, the result is the contiguous call's, bit for bit;
    an ``out`` of the wrong shape or dtype is refused by name."""
    gen = torch.Generator().manual_seed(9)
    cache, tables, lens = _paged([1, 17, 40], 16, 576, torch.float32, gen)
    q_hm = torch.randn(8, 3, 576, generator=gen)
    want = _run(kernel_ops, q_hm.transpose(0, 1).contiguous(), cache, tables, lens, 0.05, 512)
    o_hm = torch.full((8, 3, 512), float("nan"))
    got = cpu_ops.mla_decode_attention(q_hm.transpose(0, 1), cache, tables, lens, 0.05, 512,
                                       out=o_hm.transpose(0, 1))
    assert got.data_ptr() == o_hm.data_ptr()
    assert torch.equal(o_hm.transpose(0, 1), want)
    with pytest.raises(ValueError, match="out must be"):
        cpu_ops.mla_decode_attention(q_hm.transpose(0, 1), cache, tables, lens, 0.05, 512,
                                     out=torch.empty(3, 8, 511))
    with pytest.raises(ValueError, match="out must be"):
        cpu_ops.mla_decode_attention(q_hm.transpose(0, 1), cache, tables, lens, 0.05, 512,
                                     out=torch.empty(3, 8, 512, dtype=torch.float64))


def _decode_metadata(lens, tables, bs):
    rows = [tables[b, :-(-n // bs)].tolist() for b, n in enumerate(lens)]
    return AttentionMetadata.build([1] * len(lens), lens, {"full": rows}, {"full": bs}, bs, torch.device("cpu"))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 3e-5), (torch.bfloat16, 3e-2)])
def test_mla_layer_decode_kernel_and_torch_path_match_reference(kernel_ops, monkeypatch, dtype, tol):
    """MLAAttention's decode: the kernel path, the torch path (OPENINFER_CPU_KERNELS=0) and the slot-by-slot
    reference agree, with NaN in every slot no sequence owns (the torch path masks them: SDPA's masked
    scores are -inf, but a NaN value row would still poison it, so stale slots here are finite only for it)."""
    h, dn, r, dv, lora, bs = 4, 16, 8, 16, 32, 16
    lens = [1, 16, 17, 45]
    gen = torch.Generator().manual_seed(11)
    cache, tables, _ = _paged(lens, bs, lora + r, dtype, gen)
    md = _decode_metadata(lens, tables, bs)
    q_nope = torch.randn(4, h, dn, generator=gen).to(dtype)
    q_pe = torch.randn(4, h, r, generator=gen).to(dtype)
    c_kv = torch.randn(4, lora, generator=gen).to(dtype)
    k_pe = torch.randn(4, r, generator=gen).to(dtype)
    kv_b = (torch.randn(h * (dn + dv), lora, generator=gen) * 0.2).to(dtype)
    layer = MLAAttention(h, lora, dn, r, dv, (dn + r) ** -0.5)

    def run(c, kernels):
        monkeypatch.setenv("OPENINFER_CPU_KERNELS", "1" if kernels else "0")
        layer.kv_cache = c.clone()
        with set_forward_context(md):
            return layer(q_nope, q_pe, c_kv, k_pe, kv_b).float()

    fast = run(cache, True)
    torch_path = run(torch.nan_to_num(cache, nan=0.0), False)
    layer.kv_cache = cache.clone()
    with set_forward_context(md):
        layer.kv_cache.view(-1, lora + r).index_copy_(0, md.group("full").slot_mapping, torch.cat((c_kv, k_pe), -1))
        ref = reference_mla(q_nope, q_pe, md, md.group("full"), layer.kv_cache, kv_b, lora, layer.scale).float()
    ref = ref.reshape(4, -1)
    assert not fast.isnan().any()
    torch.testing.assert_close(fast, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(torch_path, ref, rtol=tol, atol=tol)


# The kernel tests above run again on the x86-64-v3 (AVX2) build: tests/test_avx2_variant.py.


# ---- the causal prefill kernel (cpu_kernels/mla_prefill.cpp) ------------------------------------------------

def _prefill_reference(q_nope, q_pe, kv, k_pe, scale, dv):
    """fp64: K = [kv's k_nope | k_pe expanded over the heads], V = kv's value columns; query i at ctx - n + i."""
    n, h, dn = q_nope.shape
    ctx = kv.shape[0]
    kvh = kv.double().view(ctx, h, dn + dv)
    k = torch.cat((kvh[..., :dn], k_pe.double()[:, None].expand(ctx, h, -1)), dim=-1)
    s = torch.einsum("ihd,jhd->hij", torch.cat((q_nope, q_pe), dim=-1).double(), k) * scale
    seen = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    p = s.masked_fill(~seen, float("-inf")).softmax(dim=-1)
    return torch.einsum("hij,jhd->ihd", p, kvh[..., dn:]).float()


@pytest.mark.parametrize("n,ctx,heads,dn,r,dv", [
    (1, 1, 1, 16, 8, 32),         # one token
    (5, 5, 3, 16, 8, 32),         # fewer queries than a block of 4
    (37, 37, 2, 128, 64, 128),    # V3 head dims, odd length
    (7, 40, 3, 128, 64, 128),     # a later chunk: 33 keys cached before it
    (3, 101, 2, 24, 8, 64),       # key count off every vector width
    (130, 130, 8, 128, 64, 128),  # the bench checkpoint's shape
])
def test_mla_prefill_kernel_matches_reference(kernel_ops, n, ctx, heads, dn, r, dv):
    gen = torch.Generator().manual_seed(1000 * n + ctx)
    # strided as the layer passes them: q_nope / q_pe halves of one projection, k_pe a column slice of the latents
    q = torch.randn(n, heads, dn + r, generator=gen)
    lat = torch.randn(ctx, 40 + r, generator=gen)
    kv = torch.randn(ctx, heads * (dn + dv), generator=gen)
    out = torch.full((n + 2, heads, dv), float("nan"))
    assert cpu_ops.mla_prefill_attention(out[1:n + 1], q[..., :dn], q[..., dn:], kv, lat[:, 40:], 0.125)
    ref = _prefill_reference(q[..., :dn], q[..., dn:], kv, lat[:, 40:], 0.125, dv)
    torch.testing.assert_close(out[1:n + 1], ref, atol=2e-5, rtol=1e-5)
    assert out[0].isnan().all() and out[-1].isnan().all()  # nothing written outside its rows


def test_mla_prefill_kernel_no_queries(kernel_ops):
    """A span with no queries (n = 0) is a no-op that the kernel takes."""
    out = torch.empty(0, 2, 32)
    assert cpu_ops.mla_prefill_attention(out, torch.randn(0, 2, 16), torch.randn(0, 2, 8), torch.randn(5, 2 * 48),
                                         torch.randn(5, 8), 0.1)


def test_mla_prefill_kernel_declines_what_it_does_not_take(kernel_ops):
    """bf16, or a value dim that is not a whole number of 2-vector tiles: False and out untouched (the layer then
    runs SDPA)."""
    q_nope, q_pe, k_pe = torch.randn(4, 2, 16), torch.randn(4, 2, 8), torch.randn(4, 8)
    out = torch.full((4, 2, 8), 7.0)
    assert not cpu_ops.mla_prefill_attention(out, q_nope, q_pe, torch.randn(4, 2 * 24), k_pe, 0.1)
    assert (out == 7.0).all()
    out16 = torch.zeros(4, 2, 32, dtype=torch.bfloat16)
    assert not cpu_ops.mla_prefill_attention(out16, q_nope.bfloat16(), q_pe.bfloat16(),
                                             torch.randn(4, 2 * 48).bfloat16(), k_pe.bfloat16(), 0.1)
    assert (out16 == 0).all()


def test_mla_prefill_kernel_rejects_bad_shapes(kernel_ops):
    q_nope, q_pe = torch.randn(4, 2, 16), torch.randn(4, 2, 8)
    out = torch.empty(4, 2, 32)
    with pytest.raises(RuntimeError, match="kv's width"):
        cpu_ops.mla_prefill_attention(out, q_nope, q_pe, torch.randn(4, 2 * 47), torch.randn(4, 8), 0.1)
    with pytest.raises(RuntimeError, match="must cover"):
        cpu_ops.mla_prefill_attention(out, q_nope, q_pe, torch.randn(3, 2 * 48), torch.randn(3, 8), 0.1)
    with pytest.raises(RuntimeError, match="k_pe"):
        cpu_ops.mla_prefill_attention(out, q_nope, q_pe, torch.randn(4, 2 * 48), torch.randn(4, 9), 0.1)


def test_mla_layer_prefill_kernel_and_sdpa_match_reference(kernel_ops, monkeypatch):
    """The layer's prefill chunks (a fresh prompt and a chunk after cached tokens, beside two decodes) through the
    kernel, through SDPA (kernel declined) and through the reference backend."""
    torch.manual_seed(0)
    h, lr, dn, r, dv, bs = 4, 32, 16, 8, 32, 4
    layer = MLAAttention(h, lr, dn, r, dv, scale=0.2)
    cache = torch.randn(24, bs, lr + r)
    kv_b = 0.2 * torch.randn(h * (dn + dv), lr)
    seqs = [([3, 7], 6, 1), ([10, 2, 20, 5], 13, 1), ([1, 4, 8, 9], 16, 7), ([11, 12, 13], 9, 9)]
    md = AttentionMetadata.build([n for _, _, n in seqs], [ctx for _, ctx, _ in seqs],
                                 {"full": [t for t, _, _ in seqs]}, {"full": bs}, bs, torch.device("cpu"))
    t = md.num_tokens
    q_nope, q_pe, c_kv, k_pe = torch.randn(t, h, dn), torch.randn(t, h, r), torch.randn(t, lr), torch.randn(t, r)
    calls = []
    kernel = cpu_ops.mla_prefill_attention

    def counted(*args):
        calls.append(kernel(*args))
        return calls[-1]

    def run(backend):
        layer.backend, layer.kv_cache = backend, cache.clone()
        with set_forward_context(md):
            return layer(q_nope, q_pe, c_kv, k_pe, kv_b)

    monkeypatch.setattr(cpu_ops, "mla_prefill_attention", counted)
    fast = run(AttentionBackend.SDPA)
    assert calls == [True, True]  # both prefill spans went through the kernel
    monkeypatch.setattr(cpu_ops, "mla_prefill_attention", lambda *args: False)
    sdpa = run(AttentionBackend.SDPA)
    ref = run(AttentionBackend.REFERENCE)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sdpa, ref, atol=1e-5, rtol=1e-5)
