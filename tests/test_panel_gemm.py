"""The fp32 panel GEMM (cpu_kernels/panel_gemm.cpp) against F.linear / bmm, and Linear on its panel layout."""
import pytest
import torch
import torch.nn.functional as F
from helpers import engine_model, make_dense_checkpoint, random_prompts

from openinfer import LLM, SamplingParams
from openinfer.layers import cpu_ops
from openinfer.layers.linear import Linear
from openinfer.platform import cpu_has_fast_bf16

pytestmark = pytest.mark.usefixtures("kernel_ops")


@pytest.mark.parametrize("n, k", [(1, 1), (15, 7), (16, 64), (17, 33), (50, 512)])
def test_pack_unpack_exact(n, k):
    w = torch.randn(3, n, k)
    wp = cpu_ops.pack_panels(w)
    assert wp.shape == (3, -(-n // 16), k, 16)
    assert torch.equal(cpu_ops.unpack_panels(wp, n), w)
    assert torch.equal(wp[:, -1, :, n % 16 or 16:], torch.zeros_like(wp[:, -1, :, n % 16 or 16:]))  # padding rows


# M: the single-row path, every row-tile size, balanced and greedy tilings, several tiles; N: ragged last panels
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 10, 13, 16, 64, 131])
@pytest.mark.parametrize("n, k", [(40, 96), (16, 1), (7, 3), (300, 257)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_gemm_matches_linear(m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    y = cpu_ops.panel_gemm(x, cpu_ops.pack_panels(w), n, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    assert y.shape == (m, n)
    torch.testing.assert_close(y, ref, atol=1e-4 * k ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("m", [1, 2, 6, 8, 13, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_gemm_bf16_matches_fp32_sums_rounded_once(m, bias):
    """bf16 weights widened in registers, x and bias widened once, fp32 sums rounded once: torch's CPU bf16 GEMM's
    roundings, so at most an ulp of summation-order difference."""
    gen = torch.Generator().manual_seed(m)
    n, k = 45, 200
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    y = cpu_ops.panel_gemm(x, cpu_ops.pack_panels(w), n, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(y.double(), ref, atol=1e-3 * k ** 0.5, rtol=2 ** -8)
    out = torch.empty(m, 3, n, dtype=torch.bfloat16).transpose(0, 1)  # batched [3, m, n], strided, bf16
    xs = torch.randn(m, 3, k, generator=gen).bfloat16().transpose(0, 1)
    ws = torch.randn(3, n, k, generator=gen).bfloat16()
    cpu_ops.panel_gemm(xs, cpu_ops.pack_panels(ws), n, out=out)
    torch.testing.assert_close(out.double(), torch.bmm(xs.double(), ws.double().transpose(1, 2)),
                               atol=1e-3 * k ** 0.5, rtol=2 ** -8)


@pytest.mark.parametrize("m", [513, 1000])  # row blocks (panel_tile.h's kRowBlock): full blocks and a ragged last one
def test_panel_gemm_row_blocks(m):
    """Prefill-sized M runs in row blocks: every block's rows right (bias, ragged last panel, batched strided
    views), and 1 and 2 threads give the same bits."""
    gen = torch.Generator().manual_seed(m)
    n, k = 37, 70
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    y = cpu_ops.panel_gemm(x, cpu_ops.pack_panels(w), n, b)
    torch.testing.assert_close(y, F.linear(x.double(), w.double(), b.double()).float(), atol=1e-4 * k ** 0.5,
                               rtol=1e-5)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(cpu_ops.panel_gemm(x, cpu_ops.pack_panels(w), n, b), y)
    finally:
        torch.set_num_threads(prev)
    xs = torch.randn(m, 2, k, generator=gen).transpose(0, 1)  # batched [2, m, k], strided
    ws = torch.randn(2, n, k, generator=gen)
    out = torch.empty(m, 2, n).transpose(0, 1)
    cpu_ops.panel_gemm(xs, cpu_ops.pack_panels(ws), n, out=out)
    torch.testing.assert_close(out, torch.bmm(xs.double(), ws.double().transpose(1, 2)).float(),
                               atol=1e-4 * k ** 0.5, rtol=1e-5)


def test_panel_gemm_leading_dims_and_empty():
    w = torch.randn(33, 20)
    wp = cpu_ops.pack_panels(w)
    x = torch.randn(2, 3, 20)
    torch.testing.assert_close(cpu_ops.panel_gemm(x, wp, 33), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert cpu_ops.panel_gemm(torch.randn(0, 20), wp, 33).shape == (0, 33)
    b = torch.randn(5)  # K = 0: an empty sum, the bias alone
    assert torch.equal(cpu_ops.panel_gemm(torch.randn(4, 0), cpu_ops.pack_panels(torch.randn(5, 0)), 5, b),
                       b.expand(4, 5))


def test_panel_gemm_batched_strided():
    """Per-head matrices, x and out as strided views (MLA's head-major bmm)."""
    h, b, k, n = 4, 9, 24, 40
    w = torch.randn(h, n, k)
    x = torch.randn(b, h, k).transpose(0, 1)  # [H, B, K], not contiguous
    out = torch.empty(b, h, n).transpose(0, 1)
    y = cpu_ops.panel_gemm(x, cpu_ops.pack_panels(w), n, out=out)
    assert y is out
    torch.testing.assert_close(out, torch.bmm(x, w.transpose(1, 2)), atol=1e-5, rtol=1e-5)


def test_panel_gemm_bad_shapes_named():
    wp = cpu_ops.pack_panels(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="panel_linear: wp must be"):
        torch.ops.openinfer_cpu.panel_linear(torch.randn(3, 9), wp, 20, None)
    with pytest.raises(ValueError, match="out is only for the batched form"):
        cpu_ops.panel_gemm(torch.randn(3, 8), wp, 20, out=torch.empty(3, 20))
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.openinfer_cpu.panel_gemm(torch.empty(1, 2, 20), torch.randn(1, 2, 9), wp.unsqueeze(0), None)
    with pytest.raises(RuntimeError, match="N in the panels"):
        torch.ops.openinfer_cpu.panel_gemm(torch.empty(1, 2, 40), torch.randn(1, 2, 8), wp.unsqueeze(0), None)
    assert cpu_ops.panel_gemm(torch.randn(2, 8).double(), wp, 20) is None  # not fp32 / bf16: the caller's torch path
    assert cpu_ops.panel_gemm(torch.randn(2, 8).bfloat16(), wp, 20) is None  # x not in wp's dtype


@pytest.mark.parametrize("panels", ["1", "0"])
def test_linear_prepack_layout_and_results(monkeypatch, panels):
    monkeypatch.setenv("OPENINFER_CPU_PANELS", panels)
    torch.manual_seed(0)
    layer = Linear(96, 70, bias=True)
    w = layer.weight.detach().clone()
    assert layer.prepack_cpu()
    assert (layer._panels is not None) == (panels == "1") and (layer._packed is not None) == (panels == "0")
    assert layer.weight.numel() == 0 and torch.equal(layer.dense_weight(), w)
    for m in (1, 8, 40):
        x = torch.randn(m, 96)
        torch.testing.assert_close(layer(x), F.linear(x, w, layer.bias), atol=1e-4, rtol=1e-5)


def test_linear_bf16_layout_follows_the_cpu(monkeypatch):
    """bf16: panels where the CPU has no native bf16 (else oneDNN's layout on AMX / AVX-512 BF16); row-major with
    OPENINFER_CPU_PREPACK=0."""
    torch.manual_seed(1)
    layer = Linear(64, 50, bias=True).bfloat16()
    w = layer.weight.detach().clone()
    assert layer.prepack_cpu()
    assert (layer._panels is not None) == (not cpu_has_fast_bf16())
    assert torch.equal(layer.dense_weight(), w)
    x = torch.randn(5, 64).bfloat16()
    ref = F.linear(x.double(), w.double(), layer.bias.double())
    torch.testing.assert_close(layer(x).double(), ref, atol=2e-2, rtol=2 ** -7)
    monkeypatch.setenv("OPENINFER_CPU_PREPACK", "0")
    plain = Linear(64, 50).bfloat16()
    assert not plain.prepack_cpu() and plain._panels is None and plain._packed is None


def test_mla_absorbed_panels_follow_kv_b_and_match_bmm(monkeypatch):
    """MLA's decode GEMMs on W_UK^T / W_UV panels: equal to the torch.bmm path, and rebuilt when kv_b's weight is
    written in place (a stale copy would keep the old weights)."""
    from openinfer.forward_context import AttentionMetadata, set_forward_context
    from openinfer.layers.mla import MLAAttention

    torch.manual_seed(0)
    h, lr, dn, r, dv, bs = 4, 40, 16, 8, 24, 4  # lr, dv not multiples of 16: ragged last panels
    attn = MLAAttention(h, lr, dn, r, dv, scale=0.2)
    cache = torch.randn(24, bs, lr + r)
    kv_b = 0.2 * torch.randn(h * (dn + dv), lr)
    seqs = [([3, 7], 6, 1), ([10, 2, 20, 5], 13, 1), ([11, 12], 7, 7)]  # two decodes and a prompt
    md = AttentionMetadata.build([n for _, _, n in seqs], [ctx for _, ctx, _ in seqs],
                                 {"full": [t for t, _, _ in seqs]}, {"full": bs}, bs, torch.device("cpu"))
    q_nope, q_pe = torch.randn(md.num_tokens, h, dn), torch.randn(md.num_tokens, h, r)
    c_kv, k_pe = torch.randn(md.num_tokens, lr), torch.randn(md.num_tokens, r)

    def run(panels: str):
        monkeypatch.setenv("OPENINFER_CPU_PANELS", panels)
        attn.kv_cache = cache.clone()
        with set_forward_context(md):
            return attn(q_nope, q_pe, c_kv, k_pe, kv_b)

    fast = run("1")
    built = attn._absorbed
    assert built is not None and built[0] is kv_b
    torch.testing.assert_close(fast, run("0"), atol=1e-5, rtol=1e-5)
    kv_b.mul_(-1.5)
    fast = run("1")
    assert attn._absorbed is not built
    torch.testing.assert_close(fast, run("0"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_absorbed_bmm_weights_contiguous_and_follow_kv_b(monkeypatch, dtype):
    """Without panels (native-bf16 CPUs, or panels off) the absorbed decode's bmm reads contiguous W_UK and W_UV^T
    copies, not strided views of kv_b (which bmm re-copied every call): in bf16 the same bits as the views, and
    rebuilt when kv_b's weight is written in place."""
    from openinfer.forward_context import AttentionMetadata, set_forward_context
    from openinfer.layers import mla

    monkeypatch.setenv("OPENINFER_CPU_PANELS", "0")
    monkeypatch.setenv("OPENINFER_CPU_BF16_DOT", "0")  # no pair panels either (the next test has them)
    torch.manual_seed(1)
    h, lr, dn, r, dv, bs = 4, 40, 16, 8, 24, 4
    attn = mla.MLAAttention(h, lr, dn, r, dv, scale=0.2)
    cache = torch.randn(24, bs, lr + r).to(dtype)
    kv_b = (0.2 * torch.randn(h * (dn + dv), lr)).to(dtype)
    seqs = [([3, 7], 6, 1), ([10, 2, 20, 5], 13, 1)]  # two decodes
    md = AttentionMetadata.build([n for _, _, n in seqs], [ctx for _, ctx, _ in seqs],
                                 {"full": [t for t, _, _ in seqs]}, {"full": bs}, bs, torch.device("cpu"))
    q_nope, q_pe = torch.randn(md.num_tokens, h, dn).to(dtype), torch.randn(md.num_tokens, h, r).to(dtype)
    c_kv, k_pe = torch.randn(md.num_tokens, lr).to(dtype), torch.randn(md.num_tokens, r).to(dtype)

    def run():
        attn.kv_cache = cache.clone()
        with set_forward_context(md):
            return attn(q_nope, q_pe, c_kv, k_pe, kv_b)

    def views(self, w):
        w_uk, w_uv = self._split_kv_b(w)
        return w_uk, w_uv.transpose(1, 2)

    prev = None
    for _ in range(2):  # then again after kv_b is written in place
        got = run()
        built = attn._absorbed_bmm
        assert built is not None and built is not prev and built[0] is kv_b
        assert built[2].is_contiguous() and built[3].is_contiguous()
        with monkeypatch.context() as m:
            m.setattr(mla.MLAAttention, "_absorbed_dense", views)
            want = run()
        if dtype == torch.bfloat16:  # oneDNN's bf16 bmm: the views were copied to this same layout first
            assert torch.equal(got, want)
        else:  # fp32 bmm blocks strided operands differently: summation order only
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        run()
        assert attn._absorbed_bmm is built  # kept while kv_b is unchanged
        prev = built
        kv_b.mul_(-1.5)


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 32])
def test_pair_panel_gemm_matches_torch(kernel_ops, m):
    """The AVX512-BF16 pair-panel GEMM (pair_panel_gemm.cpp) against fp32 torch on bf16 inputs: N off the 16-column
    panel and the 4-panel group (N = 40, 136), odd and even K, strided x and out (the MLA head-major views), row
    counts across the 6-row chunks; exact up to fp32 summation order and the one rounding to bf16. Each row's
    output is the same bits whatever rows share its chunk."""
    if not kernel_ops.pair_panels_built():
        pytest.skip("this build has no AVX512-BF16 pair-panel GEMM")
    g = torch.Generator().manual_seed(m)
    for h, n, k in ((3, 40, 17), (2, 136, 64), (1, 16, 1)):
        w = (torch.randn(h, n, k, generator=g) / k ** 0.5).bfloat16()
        wq = cpu_ops.pack_pair_panels(w)
        assert wq.shape == (h, -(-n // 16), -(-k // 2), 16, 2)
        x = torch.randn(m, h, k, generator=g).bfloat16().transpose(0, 1)  # [h, m, k] view, as MLA passes it
        out = torch.empty(m, h, n, dtype=torch.bfloat16).transpose(0, 1)
        y = cpu_ops.pair_panel_gemm(x, wq, n, out=out)
        assert y is out
        want = torch.bmm(x.float(), w.float().transpose(1, 2))
        # fp32 sums of exact products: the order costs ~k * 2^-24 relative; then one bf16 rounding (2^-8 relative)
        assert ((y.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-5 * k ** 0.5).all(), (h, n, k)
        for r in range(m):  # a lone row: the same bits
            assert torch.equal(cpu_ops.pair_panel_gemm(x[:, r:r + 1], wq, n), y[:, r:r + 1]), (h, n, k, r)


@pytest.mark.parametrize("m", [1, 3, 8, 40])
def test_linear_on_pair_panels(kernel_ops, monkeypatch, m):
    """A bf16 Linear on a native-bf16 CPU without AMX whose build has AVX512-BF16 keeps its weight in pair panels:
    exact round trip (dense_weight), bias added before the one rounding, within a bf16 step of F.linear at every M,
    counted at its logical size."""
    from openinfer.layers import dispatch
    from openinfer.layers.linear import Linear, num_parameters, weight_bytes

    monkeypatch.setenv("OPENINFER_CPU_BF16_DOT", "1")
    if not dispatch.active().pair_panels(torch.device("cpu"), torch.bfloat16):
        pytest.skip("bf16 linears are not on pair panels here (AMX, no native bf16, or no AVX512-BF16 build)")
    g = torch.Generator().manual_seed(m)
    lin = Linear(67, 50, bias=True).bfloat16()  # odd K, N off the panels and the 4-panel group
    with torch.no_grad():
        lin.weight.copy_(torch.randn(50, 67, generator=g) / 67 ** 0.5)
        lin.bias.copy_(torch.randn(50, generator=g))
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    assert lin.prepack_cpu() and lin._pairs is not None and lin._packed is None and lin.weight.numel() == 0
    assert torch.equal(lin.dense_weight(), w)
    assert num_parameters(lin) == 67 * 50 + 50 and weight_bytes(lin) >= 2 * 67 * 50
    x = torch.randn(2, m, 67, generator=g).bfloat16()
    want = x.float() @ w.float().t() + b.float()
    got = lin(x)
    assert got.shape == (2, m, 50) and got.dtype == torch.bfloat16
    assert ((got.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-4).all()


def test_mla_absorbed_pair_panels_follow_kv_b_and_match_bmm(monkeypatch):
    """bf16 MLA decode on a native-bf16 CPU whose build has AVX512-BF16: the absorbed GEMMs on pair panels, within
    bf16 rounding of the bmm path (OPENINFER_CPU_BF16_DOT=0), rebuilt when kv_b is written in place."""
    from openinfer.forward_context import AttentionMetadata, set_forward_context
    from openinfer.layers import dispatch, mla

    monkeypatch.setenv("OPENINFER_CPU_PANELS", "0")
    monkeypatch.setenv("OPENINFER_CPU_BF16_DOT", "1")
    if not dispatch.active().mla_pair_panels(torch.device("cpu"), torch.bfloat16):
        pytest.skip("bf16 stays on torch.bmm here (no native bf16 or no AVX512-BF16 build)")
    torch.manual_seed(2)
    h, lr, dn, r, dv, bs = 4, 40, 17, 8, 24, 4  # Dn odd: the last pair of W_UK^T is half zeros
    attn = mla.MLAAttention(h, lr, dn, r, dv, scale=0.2)
    cache = torch.randn(24, bs, lr + r).bfloat16()
    kv_b = (0.2 * torch.randn(h * (dn + dv), lr)).bfloat16()
    seqs = [([3, 7], 6, 1), ([10, 2, 20, 5], 13, 1)]
    md = AttentionMetadata.build([n for _, _, n in seqs], [ctx for _, ctx, _ in seqs],
                                 {"full": [t for t, _, _ in seqs]}, {"full": bs}, bs, torch.device("cpu"))
    q_nope, q_pe = torch.randn(md.num_tokens, h, dn).bfloat16(), torch.randn(md.num_tokens, h, r).bfloat16()
    c_kv, k_pe = torch.randn(md.num_tokens, lr).bfloat16(), torch.randn(md.num_tokens, r).bfloat16()

    def run(dot: str):
        monkeypatch.setenv("OPENINFER_CPU_BF16_DOT", dot)
        attn.kv_cache = cache.clone()
        with set_forward_context(md):
            return attn(q_nope, q_pe, c_kv, k_pe, kv_b)

    prev = None
    for _ in range(2):
        got = run("1")
        built = attn._absorbed_pair
        assert built is not None and built is not prev and built[0] is kv_b
        want = run("0")
        assert attn._absorbed_pair is built  # the bmm run did not touch it
        # two bf16 roundings of q_lat / o apart at most: relative 2^-7 of the values they scale, plus the sums
        torch.testing.assert_close(got.float(), want.float(), atol=0.05 * float(want.abs().max()), rtol=0)
        prev = built
        kv_b.mul_(-1.5)


@pytest.mark.parametrize("limit", [None, 0.5])
def test_moe_experts_panels_match_reference(limit):
    """The routed experts on panels at every row count per expert: none, 1 (decode), a few, many (prefill)."""
    from openinfer.layers.moe import experts_on_sorted_rows, reference_experts, fused_experts

    gen = torch.Generator().manual_seed(2)
    h, i, e = 40, 32, 6  # H not a multiple of 16: a ragged last W2 panel
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.2
    w2 = torch.randn(e, h, i, generator=gen) * 0.2
    panels = (cpu_ops.pack_panels(w13), cpu_ops.pack_panels(w2))
    counts = [0, 1, 3, 0, 70, 7]
    rows = torch.randn(sum(counts), h, generator=gen)
    got = experts_on_sorted_rows(rows, counts, torch.empty(0), torch.empty(0), limit, None, panels)
    ref = experts_on_sorted_rows(rows, counts, w13, w2, limit, None)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    t, k = 30, 2
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=gen)
    torch.testing.assert_close(fused_experts(x, None, None, wts, ids, limit, panels=panels),
                               reference_experts(x, w13, w2, wts, ids, limit), atol=1e-5, rtol=1e-5)


def test_moe_experts_panels_nan_in_idle_expert_stays_out():
    h, i, e = 16, 16, 3
    w13, w2 = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    w13[1] = float("nan")  # expert 1 gets no rows
    y = cpu_ops.moe_experts_panels(torch.randn(4, h), [2, 0, 2], cpu_ops.pack_panels(w13), cpu_ops.pack_panels(w2),
                                   None)
    assert torch.isfinite(y).all()
    with pytest.raises(RuntimeError, match="counts must sum"):
        cpu_ops.moe_experts_panels(torch.randn(4, h), [2, 0, 1], cpu_ops.pack_panels(w13), cpu_ops.pack_panels(w2),
                                   None)


def test_deepseek_experts_prepack_roundtrip(monkeypatch):
    """DeepseekExperts in panels: dense_weights gives the stacks back exactly, forward equals the plain stacks', and a
    rebalance's set_weights lands in panels again."""
    from openinfer.layers.deepseek_moe import DeepseekExperts

    torch.manual_seed(3)
    mod = DeepseekExperts(5, 24, 32)
    w13, w2 = torch.randn(5, 64, 24) * 0.2, torch.randn(5, 24, 32) * 0.2
    mod.w13_weight.data.copy_(w13)
    mod.w2_weight.data.copy_(w2)
    x, ids = torch.randn(9, 24), torch.randint(0, 5, (9, 2))
    wts = torch.rand(9, 2)
    plain = mod(x, wts, ids)
    assert mod.prepack_cpu() and mod.w13_weight.numel() == 0
    assert all(torch.equal(a, b) for a, b in zip(mod.dense_weights(), (w13, w2)))
    torch.testing.assert_close(mod(x, wts, ids), plain, atol=1e-5, rtol=1e-5)
    mod.set_weights(w13.flip(0), w2.flip(0))
    assert mod._panels is not None and torch.equal(mod.dense_weights()[0], w13.flip(0))


@pytest.mark.parametrize("dtype, lp_tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_llama_greedy_same_on_panels_and_off(tmp_path, monkeypatch, dtype, lp_tol):
    """A whole model on panels (prepacked linears) against the layouts it replaces (oneDNN fp32, row-major gemv
    bf16): same greedy tokens, logprobs within summation-order noise."""
    path = make_dense_checkpoint(tmp_path / "m", vocab_size=128, hidden_size=128, intermediate_size=256)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, [5, 20, 9], vocab_size=100)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs = []
    for panels in ("1", "0"):
        with monkeypatch.context() as mp:
            mp.setenv("OPENINFER_CPU_PANELS", panels)
            llm = LLM(model=str(path), dtype=dtype, num_kv_blocks=64)
            on = [m._panels is not None for m in engine_model(llm).modules() if isinstance(m, Linear) and m.prepack]
            runs.append((llm.generate(prompts, params, use_tqdm=False), on))
            del llm
    (fast, on), (ref, off) = runs
    assert on and all(on) == (dtype == "float32" or not cpu_has_fast_bf16()) and not any(off)
    for a, b in zip(fast, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for j, t in enumerate(a.outputs[0].token_ids):
            assert abs(a.outputs[0].logprobs[j][t] - b.outputs[0].logprobs[j][t]) < lp_tol
