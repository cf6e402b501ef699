"""Fast paths against their plain torch references: paged attention (SDPA) and grouped MoE."""
from __future__ import annotations

import pytest
import torch

from openinfer.config import AttentionBackend
from openinfer.forward_context import AttentionMetadata, set_forward_context
from openinfer.layers.attention import Attention
from openinfer.layers.moe import fused_experts, reference_experts


def build_batch(decode_lens, prefills, bs, hk, d, num_blocks, dtype, gen):
    """Random paged cache plus a mixed batch: decodes (1 query, context len L) then prefill chunks
    (query_len, context_len). Blocks are handed out in a shuffled order so tables are not contiguous."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    query_lens = [1] * len(decode_lens) + [q for q, _ in prefills]
    context_lens = list(decode_lens) + [c for _, c in prefills]
    tables = [[perm.pop() for _ in range(-(-ctx // bs))] for ctx in context_lens]
    kc = torch.randn(num_blocks, bs, hk, d, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, bs, hk, d, generator=gen).to(dtype)
    md = AttentionMetadata.build(query_lens, context_lens, {"full": tables}, {"full": bs}, bs, torch.device("cpu"))
    return md, kc, vc


# (query_len, context_len) prefill chunks: fresh ones (query == context) next to each other with one length are
# attended in one batched call, so the second list has runs of 3 and 2 split by a chunk after cached tokens.
PREFILLS = [[(5, 5), (7, 30), (16, 16), (3, 50)], [(8, 8), (8, 8), (8, 8), (7, 30), (8, 8), (8, 8), (5, 5)]]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("hq, hk", [(4, 4), (8, 2)])
@pytest.mark.parametrize("prefills", PREFILLS)
def test_sdpa_paged_attention_matches_reference(dtype, tol, hq, hk, prefills):
    gen = torch.Generator().manual_seed(0)
    bs, d = 16, 32
    md, kc, vc = build_batch([1, 17, 40, 64], prefills, bs, hk, d, 64, dtype, gen)
    t = md.num_tokens
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    k = torch.randn(t, hk, d, generator=gen).to(dtype)
    v = torch.randn(t, hk, d, generator=gen).to(dtype)
    outs = _backend_outputs(md, kc, vc, q, k, v)
    assert (outs[0] - outs[1]).abs().max() < tol


def test_fresh_prefill_runs_group_adjacent_equal_chunks():
    from openinfer.layers.attention import _fresh_prefill_runs

    md, _, _ = build_batch([1], PREFILLS[1], 16, 1, 8, 64, torch.float32, torch.Generator().manual_seed(0))
    assert _fresh_prefill_runs(md.prefills) == [(1, 3, 8), (32, 2, 8), (48, 1, 5)]


def _backend_outputs(md, kc, vc, q, k, v) -> list[torch.Tensor]:
    """The same step through the sdpa and the reference backend, each on its own copy of the cache."""
    (hq, d), hk = q.shape[1:], k.shape[1]
    outs = []
    for backend in (AttentionBackend.SDPA, AttentionBackend.REFERENCE):
        attn = Attention(hq, hk, d, d ** -0.5, backend)
        attn.k_cache, attn.v_cache = kc.clone(), vc.clone()
        with set_forward_context(md):
            outs.append(attn(q, k, v).float())
    return outs


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("packed", [False, True])
def test_grouped_moe_matches_reference(dtype, tol, limit, packed):
    from openinfer.layers import dispatch
    from openinfer.layers.moe import pack_experts

    if packed and not dispatch.active().onednn_prepack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN prepacking is off for {dtype} on this CPU")
    gen = torch.Generator().manual_seed(1)
    t, h, i, e, k = 45, 64, 32, 9, 3
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * 0.1).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[:5] = 2  # an expert with many rows and (below) experts with none
    ids[:5, 1], ids[:5, 2] = 3, 4
    ids[ids == 8] = 7  # expert 8 gets no rows
    w = torch.rand(t, k, generator=gen)
    got = fused_experts(x, w13, w2, w, ids, limit, packed=pack_experts(w13, w2) if packed else None).float()
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


# ---- the C++ paged decode-attention kernel (openinfer/layers/cpu_ops.py) --------------------------------

DECODE_LENS = [1, 15, 16, 17, 50, 300, 3]  # around the block size 16, several blocks, long


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("hq, hk", [(16, 4), (4, 4)])
# 64/128 specialised; 80 and 72 take the generic loops (72: the scalar ones on 16-lane builds); 36 the scalar ones
# on 8-lane builds too
@pytest.mark.parametrize("d", [64, 128, 80, 72, 36])
def test_paged_decode_kernel_matches_reference_and_sdpa(kernel_ops, dtype, tol, hq, hk, d):
    from openinfer.layers import cpu_ops
    from openinfer.layers.attention import reference_paged_attention

    gen = torch.Generator().manual_seed(d + hq)
    md, kc, vc = build_batch(DECODE_LENS, [], 16, hk, d, 96, dtype, gen)
    q = torch.randn(md.num_decodes, hq, d, generator=gen).to(dtype)
    scale = d ** -0.5
    got = cpu_ops.paged_decode_attention(q, kc, vc, md.group("full").decode_block_tables, md.decode_seq_lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    ref = reference_paged_attention(q, md, md.group("full"), kc, vc, scale)
    assert (got.float() - ref.float()).abs().max() < tol
    attn = Attention(hq, hk, d, scale)
    attn.k_cache, attn.v_cache = kc, vc
    sdpa = attn._decode_gather_sdpa(q, md, md.group("full"))
    # bf16 SDPA rounds its intermediates to bf16; the kernel and the reference keep fp32 until the output.
    assert (got.float() - sdpa.float()).abs().max() < (tol if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("hq, hk, d, bs", [(16, 4, 64, 16), (16, 1, 128, 16), (4, 4, 64, 32), (6, 2, 128, 16)])
def test_paged_decode_kernel_amx_and_vector_paths(kernel_ops, amx, hq, hk, d, bs):
    """bf16 caches take AMX tiles where the CPU has them (head_dim % 64, block_size % 16, <= 16 q heads per kv
    head); both paths against the fp32 reference, with NaN planted in the unused slots of partly filled blocks
    (stale cache rows must never reach the output)."""
    from openinfer.platform import cpu_info
    from openinfer.layers import cpu_ops
    from openinfer.layers.attention import reference_paged_attention

    has_amx = kernel_ops.decode_attention_use_amx(amx)
    try:
        if amx and not __import__("os").environ.get("OPENINFER_KERNEL_CFLAGS"):
            assert has_amx == ("amx_bf16" in cpu_info()[1])  # a native build on an AMX CPU must use it
        gen = torch.Generator().manual_seed(d + hq + bs)
        md, kc, vc = build_batch([1, 15, 16, 17, 33, 50, 300, 3, 64], [], bs, hk, d, 160, torch.bfloat16, gen)
        for b, n in enumerate(md.decode_seq_lens.tolist()):  # NaN in every slot past each sequence's end
            last = md.group("full").decode_block_tables[b, (n - 1) // bs]
            kc[last, (n - 1) % bs + 1:] = float("nan")
            vc[last, (n - 1) % bs + 1:] = float("nan")
        q = torch.randn(md.num_decodes, hq, d, generator=gen).bfloat16()
        got = cpu_ops.paged_decode_attention(q, kc, vc, md.group("full").decode_block_tables, md.decode_seq_lens, d ** -0.5)
        ref = reference_paged_attention(q, md, md.group("full"), kc, vc, d ** -0.5)
        assert not got.isnan().any() and (got.float() - ref.float()).abs().max() < 1e-2
    finally:
        kernel_ops.decode_attention_use_amx(True)


def test_paged_decode_kernel_edge_cases(kernel_ops):
    from openinfer.layers import cpu_ops
    from openinfer.layers.attention import reference_paged_attention

    gen = torch.Generator().manual_seed(3)
    md, kc, vc = build_batch([5, 40], [], 16, 2, 64, 16, torch.float32, gen)
    # q with strides (a slice of a wider projection) and a bf16 q over an fp32 cache
    wide = torch.randn(2, 4, 96, generator=gen)
    q = wide[:, :, 16:80]
    got = cpu_ops.paged_decode_attention(q, kc, vc, md.group("full").decode_block_tables, md.decode_seq_lens, 0.1)
    ref = reference_paged_attention(q.contiguous(), md, md.group("full"), kc, vc, 0.1)
    assert (got - ref).abs().max() < 1e-5
    got16 = cpu_ops.paged_decode_attention(q.bfloat16(), kc, vc, md.group("full").decode_block_tables, md.decode_seq_lens,
                                           0.1)
    assert got16.dtype == torch.bfloat16 and (got16.float() - ref).abs().max() < 2e-2
    # a zero-length sequence gives zeros (no 0/0), without touching its table row
    lens0 = torch.tensor([0, 40])
    out0 = cpu_ops.paged_decode_attention(q, kc, vc, md.group("full").decode_block_tables, lens0, 0.1)
    assert torch.equal(out0[0], torch.zeros_like(out0[0])) and torch.allclose(out0[1], ref[1], atol=1e-5)
    # bad inputs are errors, not out-of-bounds reads
    bad = md.group("full").decode_block_tables.clone()
    bad[1, 1] = 10_000
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.paged_decode_attention(q, kc, vc, bad, md.decode_seq_lens, 0.1)
    with pytest.raises(RuntimeError, match="needs"):
        cpu_ops.paged_decode_attention(q, kc, vc, md.group("full").decode_block_tables, torch.tensor([5, 1000]), 0.1)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_ops.paged_decode_attention(q, kc.transpose(1, 2), vc.transpose(1, 2), md.group("full").decode_block_tables,
                                       md.decode_seq_lens, 0.1)
    with pytest.raises(RuntimeError, match="multiple"):
        cpu_ops.paged_decode_attention(torch.randn(2, 3, 64), kc, vc, md.group("full").decode_block_tables,
                                       md.decode_seq_lens, 0.1)


def _mixed_attention_outputs(hq=8, hk=2, d=64, dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)
    md, kc, vc = build_batch([1, 17, 40, 64, 200], [(5, 5), (7, 30)], 16, hk, d, 64, dtype, gen)
    t = md.num_tokens
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hk, hk))
    return _backend_outputs(md, kc, vc, q, k, v)


def test_attention_uses_kernel_for_cpu_decodes(kernel_ops, monkeypatch):
    from openinfer.layers import cpu_ops

    calls = []
    real = cpu_ops.paged_decode_attention
    monkeypatch.setattr(cpu_ops, "paged_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(Attention, "_decode_gather_sdpa", lambda *a: pytest.fail("took the gather+SDPA path"))
    fast, ref = _mixed_attention_outputs()
    assert calls and (fast - ref).abs().max() < 1e-5


def test_attention_runs_torch_on_the_torch_backend(monkeypatch, caplog):
    """OPENINFER_CPU_KERNELS=0 (the torch backend): the gather + SDPA path, the same values, and no warning."""
    from openinfer.layers import cpu_ops

    monkeypatch.setenv("OPENINFER_CPU_KERNELS", "0")
    used = []
    real = Attention._decode_gather_sdpa
    monkeypatch.setattr(Attention, "_decode_gather_sdpa", lambda *a: used.append(1) or real(*a))
    with caplog.at_level("WARNING", logger="openinfer"):
        fast, ref = _mixed_attention_outputs()
    assert used and (fast - ref).abs().max() < 2e-5
    assert cpu_ops.get_ops() is None
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_broken_kernel_build_is_an_error_not_a_slow_path(monkeypatch):
    """A build that fails raises KernelBuildError naming the compiler's first error and the opt-out (the engine
    refuses to start), the same error on every later ask; the torch backend asks for no build and runs."""
    from openinfer.config import KernelConfig
    from openinfer.layers import dispatch, kernel_build

    def broken(*args):
        raise RuntimeError("Error building extension 'x':\nfoo.cpp:1:1: error: no compiler today\n")

    monkeypatch.setattr(kernel_build, "_results", {})
    monkeypatch.setattr(kernel_build, "_build", broken)
    monkeypatch.setattr(dispatch, "_defaults", {})
    for _ in range(2):
        with pytest.raises(dispatch.KernelBuildError, match="no compiler today.*--kernel-backend torch"):
            dispatch.select(KernelConfig(backend="auto"))
    with pytest.raises(dispatch.KernelBuildError, match="no compiler today"):
        dispatch.active()  # outside an engine too: no quiet fallback
    sel = dispatch.select(KernelConfig(backend="torch"))
    assert sel.ops is None and sel.backend == "torch" and "not built" in sel.build
    used = []
    real = Attention._decode_gather_sdpa
    monkeypatch.setattr(Attention, "_decode_gather_sdpa", lambda *a: used.append(1) or real(*a))
    with dispatch.use(sel):
        fast, ref = _mixed_attention_outputs()
    assert used and (fast - ref).abs().max() < 2e-5


# The kernel tests above run again on the x86-64-v3 (AVX2) build: tests/test_avx2_variant.py.
