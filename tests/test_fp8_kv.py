"""kv_cache_dtype="fp8" (float8_e4m3fn, scale 1.0): the cache write, the C++ decode kernels reading e4m3 directly
against the torch reference, the torch paths, the engine end to end (greedy agreement with the unquantized cache,
prefix caching and chunked prefill unchanged) and the errors for what is not supported."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import engine_model, make_dense_checkpoint, random_prompts

from openinfer import LLM, SamplingParams
from openinfer.config import AttentionBackend, CacheConfig
from openinfer.engine_args import EngineArgs
from openinfer.forward_context import AttentionMetadata, set_forward_context
from openinfer.layers.attention import Attention, reference_paged_attention
from openinfer.layers.kv_quant import FP8_DTYPE, as_cached, to_cache
from openinfer.layers.mla import MLAAttention

NAN_CODE = 0x7F  # e4m3fn's NaN (0xFF too); it has no infinity


def _fp8_from_codes(codes: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.uint8).view(FP8_DTYPE)


# ---- the write ------------------------------------------------------------------------------------------------

def test_to_cache_saturates_and_keeps_nan():
    x = torch.tensor([0.0, 1.0, -3.3, 447.0, 449.0, 1e6, -1e6, float("inf"), float("-inf"), float("nan")])
    got = to_cache(x, FP8_DTYPE)
    assert got.dtype == FP8_DTYPE
    back = got.float()
    assert back[:4].tolist() == [0.0, 1.0, -3.25, 448.0]  # round to nearest e4m3
    assert back[4:9].tolist() == [448.0, 448.0, -448.0, 448.0, -448.0]  # saturate
    assert back[9].isnan()  # a NaN is not turned into a plausible number
    # bf16 input too, and the round trip the fresh prefill chunks use
    xb = torch.randn(64, dtype=torch.bfloat16) * 100
    assert torch.equal(as_cached(xb, FP8_DTYPE), to_cache(xb, FP8_DTYPE).to(torch.bfloat16))
    assert as_cached(xb, torch.bfloat16) is xb


# ---- the C++ kernels on fp8 caches -------------------------------------------------------------------------------

def _build_batch(lens, bs, hk, d, gen, spare=4, dtype=FP8_DTYPE):
    """A shuffled paged K/V cache for decodes of ``lens``: every slot no sequence owns holds e4m3 NaN."""
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + spare
    perm = torch.randperm(nb, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(k)] for k in need]
    kc = torch.full((nb, bs, hk, d), float("nan"))
    vc = torch.full((nb, bs, hk, d), float("nan"))
    for table, n in zip(tables, lens):
        for p in range(n):
            kc[table[p // bs], p % bs] = torch.randn(hk, d, generator=gen) * 2
            vc[table[p // bs], p % bs] = torch.randn(hk, d, generator=gen) * 2
    md = AttentionMetadata.build([1] * len(lens), list(lens), {"full": tables}, {"full": bs}, bs,
                                 torch.device("cpu"))
    return md, to_cache(kc, dtype), to_cache(vc, dtype)


DECODE_LENS = [1, 15, 16, 17, 33, 50, 130, 3]  # odd lengths and every side of the block boundary


FP32_ERR = 2e-5  # the fp32 kernel's and torch path's measured bound against the fp32 reference (the fp32 cases)


def _bf16_bound(exact: torch.Tensor, err) -> torch.Tensor:
    """What a bf16 output may differ from the unrounded ``exact`` when it was computed with absolute error ``err``
    and then rounded to nearest: half a bf16 step at |exact + e| (bf16 keeps 8 significant bits, so half its step at
    x is at most 2^-8 |x|), plus ``err``. The rounding part is relative: a fixed tolerance below one step fails on
    one output that rounds the other way in the top binades (a step is 2^-5 = 0.03125 in [4, 8), 2^-4 in [8, 16))."""
    return 2 ** -8 * (exact.abs() + err) + err


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hk, d", [(8, 2, 64), (4, 4, 128), (6, 3, 80), (4, 1, 72)])
def test_fp8_paged_decode_kernel_matches_reference(kernel_ops, qdtype, hq, hk, d):
    """The kernel widens e4m3 in registers; the reference dequantizes the slots it reads with torch's cast. NaN in
    every stale slot (past each length, partly filled last blocks, unused blocks) must never reach the output.

    Bounds against the fp32 reference (a bf16 q is exact in fp32, e4m3 is exact in bf16 and fp32): the kernel computes
    in fp32 whatever q's dtype, so a bf16 output is the fp32 result within FP32_ERR, rounded once. The torch path's
    SDPA runs in bf16 where bf16 matmuls are native (AVX512-BF16 / AMX hosts; fp32 elsewhere, attention._decode_dtype):
    scores and sums stay fp32, but the probabilities are rounded to bf16 for the P @ V product (checked: modelling
    exactly that reproduces 97 % of its outputs bit for bit, an all-fp32 model 78 %). Each p_l is off by at most
    2^-9 p_l, so the output is off by at most 2^-9 sum_l p_l |v_l| / sum_l p_l <= 2^-9 max |v| (measured at most
    0.62 of that over 80 random batches), then rounded. A fixed 3e-2 failed there: one output of 4.0467 rounded
    to 4.0625 instead of 4.03125, one bf16 step (0.03125) from the rounded reference."""
    from openinfer.layers import cpu_ops

    gen = torch.Generator().manual_seed(d + hq)
    md, kc, vc = _build_batch(DECODE_LENS, 16, hk, d, gen)
    q = torch.randn(md.num_decodes, hq, d, generator=gen).to(qdtype)
    tables = md.group("full")
    got = cpu_ops.paged_decode_attention(q, kc, vc, tables.decode_block_tables, md.decode_seq_lens, d ** -0.5)
    exact = reference_paged_attention(q.float(), md, tables, kc, vc, d ** -0.5)  # fp32, not rounded to q's dtype
    assert got.dtype == qdtype and not got.isnan().any()
    bf16 = qdtype == torch.bfloat16
    assert ((got.float() - exact).abs() <= (_bf16_bound(exact, FP32_ERR) if bf16 else FP32_ERR)).all()
    # the torch fallback (gather + SDPA) over the same fp8 cache, stale NaN included
    attn = Attention(hq, hk, d, d ** -0.5)
    attn.k_cache, attn.v_cache = kc, vc
    torch_path = attn._decode_gather_sdpa(q, md, tables)
    assert not torch_path.isnan().any()
    vmax = vc.float().nan_to_num(0).abs().max()  # over the values the sequences own (stale slots hold NaN)
    bound = _bf16_bound(exact, 2 ** -9 * vmax + FP32_ERR) if bf16 else FP32_ERR
    assert ((torch_path.float() - exact).abs() <= bound).all()


def test_fp8_decode_is_exact_for_every_code(kernel_ops):
    """All 254 finite e4m3 codes (normals, subnormals, zeros, both signs) as values, read by the kernel: with one
    key the output is that row exactly; a NaN code in a slot the sequence owns propagates as in the reference
    (the in-register conversion maps 0x7F / 0xFF to NaN, not to 480)."""
    from openinfer.layers import cpu_ops

    codes = torch.tensor([c for c in range(256) if c & 0x7F != NAN_CODE])
    d = 16
    n = codes.numel() // d  # 15 rows of 16 codes (the last few codes go to a second pass below)
    for part in (codes[:n * d], codes[-n * d:]):
        vals = _fp8_from_codes(part).view(n, 1, 1, d)  # n blocks of one slot, one kv head
        keys = torch.zeros_like(vals)
        md = AttentionMetadata.build([1] * n, [1] * n, {"full": [[i] for i in range(n)]}, {"full": 1}, 1,
                                     torch.device("cpu"))
        q = torch.randn(n, 2, d)
        got = cpu_ops.paged_decode_attention(q, keys, vals, md.group("full").decode_block_tables,
                                             md.decode_seq_lens, 1.0)
        want = vals.float().view(n, 1, d).expand(n, 2, d)
        assert torch.equal(got, want)
    # a NaN the sequence owns is the model's NaN: it shows, as in the reference
    md, kc, vc = _build_batch([20], 16, 1, 16, torch.Generator().manual_seed(0))
    table = md.group("full").decode_block_tables
    kc[table[0, 1], 2, 0, 5] = _fp8_from_codes(torch.tensor([NAN_CODE]))[0]
    q = torch.randn(1, 1, 16)
    got = cpu_ops.paged_decode_attention(q, kc, vc, table, md.decode_seq_lens, 1.0)
    assert got.isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rotary_cache_write_kernel_matches_torch_write(kernel_ops, dtype):
    """Llama's fused rotary + cache write into fp8 caches stores the bytes the torch write stores (saturation at
    448 included), so the fast path and the reference backend read the same cache."""
    from openinfer.layers import cpu_ops
    from openinfer.layers.kv_quant import write_rows
    from openinfer.layers.rotary import RotaryEmbedding, apply_neox

    gen = torch.Generator().manual_seed(4)
    t, hq, hk, d, bs = 21, 4, 2, 64, 16
    rope = RotaryEmbedding(d, {"rope_theta": 10000.0, "rope_type": "default"}, 512)
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 200).to(dtype)  # many values beyond 448
    positions = torch.randint(0, 512, (t,), generator=gen)
    slots = torch.randperm(4 * bs, generator=gen)[:t]
    qk = apply_neox(qkv[:, :(hq + hk) * d].view(t, hq + hk, d), *rope.cos_sin(positions))
    want_k = torch.zeros(4 * bs, hk, d, dtype=FP8_DTYPE)
    want_v = torch.zeros(4 * bs, hk, d, dtype=FP8_DTYPE)
    write_rows(want_k, slots, qk[:, hq:])
    write_rows(want_v, slots, qkv[:, (hq + hk) * d:].view(t, hk, d))
    kc = torch.zeros(4, bs, hk, d, dtype=FP8_DTYPE)
    vc = torch.zeros(4, bs, hk, d, dtype=FP8_DTYPE)
    assert cpu_ops.rotary_cache_write_(qkv, positions, rope.cos, rope.sin, kc, vc, slots, hq, hk, d, d)
    assert torch.equal(vc.view(-1, hk, d).view(torch.uint8), want_v.view(torch.uint8))
    assert kc.view(-1, hk, d).float().abs().max() == 448.0
    if dtype == torch.float32:  # the kernel's rotation rounds like torch's in fp32; bf16 may differ by 1 ulp first
        assert torch.equal(kc.view(-1, hk, d).view(torch.uint8), want_k.view(torch.uint8))
    else:
        assert (kc.view(-1, hk, d).float() - want_k.float()).abs().max() <= 32  # one e4m3 step at the top


def _mla_batch(lens, bs, d, gen, spare=3):
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + spare
    perm = torch.randperm(nb, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(need), dtype=torch.long)
    cache = torch.full((nb, bs, d), float("nan"))
    for b, (n, k) in enumerate(zip(lens, need)):
        blocks = [perm.pop() for _ in range(k)]
        tables[b, :k] = torch.tensor(blocks)
        for p in range(n):
            cache[blocks[p // bs], p % bs] = torch.randn(d, generator=gen)
    return to_cache(cache, FP8_DTYPE), tables, torch.tensor(lens)


@pytest.mark.parametrize("d, dv", [(576, 512), (40, 32), (144, 112)])
@pytest.mark.parametrize("qdtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_fp8_mla_decode_kernel_matches_reference(kernel_ops, d, dv, qdtype, tol):
    gen = torch.Generator().manual_seed(d)
    lens = [0, 1, 16, 17, 33, 5, 64]
    cache, tables, seq_lens = _mla_batch(lens, 16, d, gen)
    q = torch.randn(len(lens), 8, d, generator=gen).to(qdtype)
    out = torch.empty(len(lens), 8, dv, dtype=qdtype)
    kernel_ops.mla_decode_attention(out, q, cache, tables, seq_lens, d ** -0.5)
    ref = torch.zeros(len(lens), 8, dv)
    for b, n in enumerate(lens):
        if n:
            rows = torch.stack([cache[tables[b, p // 16], p % 16] for p in range(n)]).float()
            ref[b] = torch.softmax(q[b].float() @ rows.t() * d ** -0.5, dim=-1) @ rows[:, :dv]
    assert not out.isnan().any()
    assert (out.float() - ref).abs().max() < tol


def test_fp8_mla_layer_kernel_and_torch_path_match_reference(kernel_ops, monkeypatch):
    """The MLA layer over an fp8 latent cache: a mixed step (decodes, a fresh chunk, a chunk after cached tokens)
    through the fast path with and without the kernel, against the reference backend; stale slots hold NaN."""
    from openinfer.layers import cpu_ops

    gen = torch.Generator().manual_seed(7)
    h, lr, dn, r, dv, bs = 4, 32, 16, 8, 16, 16
    decode_lens, prefills = [1, 17, 40], [(9, 9), (6, 35)]
    qlens = [1] * len(decode_lens) + [q for q, _ in prefills]
    ctx = decode_lens + [c for _, c in prefills]
    perm = torch.randperm(40, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctx]
    md = AttentionMetadata.build(qlens, ctx, {"full": tables}, {"full": bs}, bs, torch.device("cpu"))
    base = torch.full((40, bs, lr + r), float("nan"))
    for table, c, q in zip(tables, ctx, qlens):  # the cached part of each sequence
        for p in range(c - q):
            base[table[p // bs], p % bs] = torch.randn(lr + r, generator=gen)
    base = to_cache(base, FP8_DTYPE)
    t = md.num_tokens
    q_nope, q_pe = torch.randn(t, h, dn, generator=gen), torch.randn(t, h, r, generator=gen)
    c_kv, k_pe = torch.randn(t, lr, generator=gen), torch.randn(t, r, generator=gen)
    w = torch.randn(h * (dn + dv), lr, generator=gen) * 0.2
    outs = {}
    for name, backend, kernels in [("ref", AttentionBackend.REFERENCE, True), ("kernel", AttentionBackend.SDPA, True),
                                   ("torch", AttentionBackend.SDPA, False)]:
        monkeypatch.setenv("OPENINFER_CPU_KERNELS", "1" if kernels else "0")
        layer = MLAAttention(h, lr, dn, r, dv, (dn + r) ** -0.5, backend)
        layer.kv_cache = base.clone()
        with set_forward_context(md):
            outs[name] = layer(q_nope, q_pe, c_kv, k_pe, w)
        assert layer.kv_cache.dtype == FP8_DTYPE
    assert not outs["kernel"].isnan().any() and not outs["torch"].isnan().any()
    torch.testing.assert_close(outs["kernel"], outs["ref"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs["torch"], outs["ref"], rtol=1e-4, atol=1e-4)


def test_fp8_attention_layer_sdpa_matches_reference(kernel_ops):
    """The paged Attention layer over fp8 caches: a mixed step through sdpa (kernel decodes, fresh chunks, a chunk
    after cached tokens) and the reference backend; what it wrote is the saturated e4m3 of k and v."""
    gen = torch.Generator().manual_seed(11)
    hq, hk, d, bs = 8, 2, 64, 16
    decode_lens, prefills = [1, 17, 40, 64], [(5, 5), (16, 16), (7, 30)]
    qlens = [1] * len(decode_lens) + [q for q, _ in prefills]
    ctx = decode_lens + [c for _, c in prefills]
    perm = torch.randperm(48, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-c // bs))] for c in ctx]
    md = AttentionMetadata.build(qlens, ctx, {"full": tables}, {"full": bs}, bs, torch.device("cpu"))
    kc = to_cache(torch.randn(48, bs, hk, d, generator=gen), FP8_DTYPE)
    vc = to_cache(torch.randn(48, bs, hk, d, generator=gen), FP8_DTYPE)
    t = md.num_tokens
    q, k, v = (torch.randn(t, n, d, generator=gen) for n in (hq, hk, hk))
    k[0, 0, 0] = 1000.0  # beyond e4m3's range: saturates to 448
    outs, caches = [], []
    for backend in (AttentionBackend.SDPA, AttentionBackend.REFERENCE):
        attn = Attention(hq, hk, d, d ** -0.5, backend)
        attn.k_cache, attn.v_cache = kc.clone(), vc.clone()
        with set_forward_context(md):
            outs.append(attn(q, k, v))
        caches.append(attn.k_cache)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    slot = md.group("full").slot_mapping[0]
    assert caches[0].view(-1, hk, d)[slot, 0, 0].float() == 448.0
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


# The kernel tests above run again on the x86-64-v3 (AVX2) build: tests/test_avx2_variant.py.


# ---- the engine -------------------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)


def agreement(base, fp8) -> tuple[int, int, float, float]:
    """(prompts whose greedy tokens are all identical, prompts whose first token is, mean tokens matched before the
    first difference, mean |logprob diff| of the chosen tokens up to and including the first difference)."""
    same = first = 0
    prefix, diffs = [], []
    for a, b in zip(base, fp8):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        same += ta == tb
        first += ta[0] == tb[0]
        n = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        prefix.append(n)
        for j in range(min(n + 1, len(ta))):
            diffs.append(abs(a.outputs[0].logprobs[j][ta[j]] - b.outputs[0].logprobs[j][tb[j]]))
    return same, first, sum(prefix) / len(prefix), sum(diffs) / len(diffs)


def _generate(llm, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def _engine_checks(path, prompts, **kw):
    base = _generate(LLM(str(path), dtype="float32", num_kv_blocks=64, **kw), prompts)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, kv_cache_dtype="fp8", **kw)
    model = engine_model(llm)
    assert {_store_kind(a) for a in model.attention_layers()} == {"fp8"}
    fp8 = _generate(llm, prompts)
    # the fast path over the fp8 cache is the reference backend over it, token for token
    ref = _generate(LLM(str(path), dtype="float32", num_kv_blocks=64, kv_cache_dtype="fp8",
                        attention_backend="reference", **kw), prompts)
    assert [o.outputs[0].token_ids for o in ref] == [o.outputs[0].token_ids for o in fp8]
    # prefix caching: the same prompts again hit their cached blocks and give the same tokens
    again = _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in fp8]
    assert any(o.num_cached_tokens > 0 for o in again)
    # chunked prefill: 8-token chunks read their earlier chunks from the fp8 cache
    chunked = _generate(LLM(str(path), dtype="float32", num_kv_blocks=64, kv_cache_dtype="fp8",
                            max_num_batched_tokens=8, enable_prefix_caching=False, **kw), prompts)
    assert [o.outputs[0].token_ids for o in chunked] == [o.outputs[0].token_ids for o in fp8]
    return agreement(base, fp8)


def _store_kind(layer) -> str:
    if hasattr(layer, "cache"):  # DeepSeek-V4: packed fp8_ds_mla latent stores
        return "fp8" if layer.cache.ds_mla is not None and layer.cache.kv.dtype == torch.uint8 else "other"
    cache = layer.kv_cache if hasattr(layer, "kv_cache") else layer.k_cache
    return "fp8" if cache.dtype == FP8_DTYPE else "other"


def _report_and_check(name, prompts, result, max_mean_lp: float = 0.05):
    same, first, prefix, mean_lp = result
    print(f"\nfp8 KV vs fp32 KV, {name}: identical greedy tokens on {same} of {len(prompts)} prompts "
          f"({GREEDY.max_tokens} tokens each), first token on {first} of {len(prompts)}, {prefix:.1f} tokens "
          f"matched on average before a difference, mean |logprob diff| {mean_lp:.4f}")
    # The tiny random models' next-token distributions are nearly flat (chosen logprobs ~ -3.3 of a uniform
    # -4.85), so fp8's rounding legitimately flips close calls and a flip changes the rest of the sequence. A
    # broken read (wrong decode, NaN, stale rows) moves the logprobs far more than this and every first token.
    assert first >= len(prompts) // 2 and mean_lp < max_mean_lp


def test_fp8_engine_llama_agreement(tmp_path, capsys):
    path = make_dense_checkpoint(tmp_path / "llama", vocab_size=128)
    prompts = random_prompts(3, [5, 40, 17, 70, 3, 33], vocab_size=128)
    result = _engine_checks(path, prompts)
    with capsys.disabled():
        _report_and_check("tiny Llama", prompts, result)


def test_fp8_engine_deepseek_v3_agreement(tmp_path, capsys):
    from test_deepseek_v3 import make_hf_v3

    path = make_hf_v3(tmp_path / "v3")
    prompts = random_prompts(3, [5, 40, 17, 70, 3, 33], vocab_size=128)
    result = _engine_checks(path, prompts)
    with capsys.disabled():
        _report_and_check("tiny DeepSeek-V3 (MLA latent)", prompts, result)


def test_fp8_engine_deepseek_v4_agreement(tmp_path, capsys):
    from helpers import load_script

    path = load_script("make_deepseek_v4_checkpoint").make_checkpoint(tmp_path / "v4", "tiny", seed=0)
    prompts = random_prompts(3, [5, 40, 17, 70, 3, 33])
    result = _engine_checks(path, prompts, max_model_len=128)
    with capsys.disabled():
        # V4's tiny model is more sensitive to rounding than the others: bf16 weights + bf16 KV already move its
        # chosen logprobs by 0.038 on average against fp32 (Llama: 0.006); fp8 KV moves them ~3x what bf16 does
        # on both (measured 0.11 and 0.017).
        _report_and_check("tiny DeepSeek-V4 (fp8_ds_mla latents and entries, fp8 indexer keys)", prompts, result, 0.25)


# ---- fp8_ds_mla (DeepSeek-V4) -------------------------------------------------------------------------------------

def test_ds_mla_layout_matches_vllm_sizes_and_round_trips():
    from openinfer.layers.kv_quant import DsMlaLayout

    lay = DsMlaLayout(512, 64)
    assert (lay.nope, lay.tiles, lay.scale_bytes, lay.row_bytes) == (448, 7, 8, 584)  # vLLM: 448 + 128 + 8
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 512, generator=gen) * torch.tensor([1, 1e3, 1e-3, 5, 0.1, 1])[:, None]
    x[5] = 0.0
    rows = lay.pack(x)
    assert rows.dtype == torch.uint8 and rows.shape == (6, 584)
    back = lay.unpack(rows, torch.float32)
    # rope values are bf16; each 64-value tile is e4m3 under a power-of-two scale >= amax / 448
    assert torch.equal(back[:, 448:], x[:, 448:].bfloat16().float())
    tiles = x[:, :448].view(6, 7, 64)
    err = (back[:, :448].view(6, 7, 64) - tiles).abs().amax(-1)
    assert (err <= tiles.abs().amax(-1) * 2 ** -3 + 1e-12).all()
    assert torch.equal(back[5], torch.zeros(512))
    scales = rows[:, 448 + 128:]
    assert (scales[:, 7] == 0).all() and (scales[:4, :7] > 100).all()  # UE8M0 bytes, the 8th is padding
    bad = x[:1].clone()
    bad[0, 3] = float("nan")
    assert lay.unpack(lay.pack(bad), torch.float32)[0, :64].isnan().any()  # a NaN is not hidden


def test_fp8_row_layout_and_indexer_kernel_read_packed_keys(kernel_ops):
    """V4's indexer keys under fp8: 132 B per 128-d key; the top-k kernel over the packed rows picks what it picks
    over the same keys dequantized."""
    from openinfer.layers import cpu_ops
    from openinfer.layers.kv_quant import Fp8RowLayout

    lay = Fp8RowLayout(128)
    assert lay.row_bytes == 132
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(40, 128, generator=gen) * torch.rand(40, 1, generator=gen) * 10
    packed = lay.pack(keys)
    deq = lay.unpack(packed, torch.float32)
    assert ((deq - keys).abs().amax(-1) <= keys.abs().amax(-1) * 2 ** -4 + 1e-6).all()
    q = torch.randn(5, 4, 128, generator=gen)
    head_w = torch.rand(5, 4, generator=gen)
    seq_slots = torch.randperm(40, generator=gen)[:30].view(2, 15)
    token_seq, visible = torch.tensor([0, 0, 1, 1, 0]), torch.tensor([3, 15, 9, 0, 12])
    want = cpu_ops.indexer_topk(q, head_w, deq, seq_slots, token_seq, visible, 6, 0.1)
    got = cpu_ops.indexer_topk(q, head_w, packed, seq_slots, token_seq, visible, 6, 0.1)
    assert got is not None and torch.equal(got, want)


def test_fp8_v4_sparse_kernel_reads_packed_rows(kernel_ops):
    """The V4 sink/sparse kernel over fp8_ds_mla stores against the same kernel over the dequantized rows."""
    from openinfer.layers import cpu_ops
    from openinfer.layers.kv_quant import DsMlaLayout

    gen = torch.Generator().manual_seed(3)
    d, rope, bs, window, h = 512, 64, 16, 20, 4
    lay = DsMlaLayout(d, rope)
    kv = torch.randn(6 * bs, d, generator=gen)
    entries = torch.randn(10, d, generator=gen) * 3
    kvp, entp = lay.pack(kv), lay.pack(entries)
    kvd, entd = lay.unpack(kvp, torch.float32), lay.unpack(entp, torch.float32)
    tables = torch.tensor([[3, 1, 5, 0], [2, 4, 0, 0]])
    token_seq = torch.tensor([0, 0, 1, 0])
    positions = torch.tensor([0, 37, 17, 63])
    entry_slots = torch.tensor([[-1, -1, -1], [1, 7, -1], [2, -1, 9], [0, 4, 5]])
    sinks = torch.randn(h, generator=gen)
    for qdtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        q = torch.randn(4, h, d, generator=gen).to(qdtype)
        want = cpu_ops.sink_sparse_attention(q, kvd, tables, token_seq, positions, bs, window, entd, entry_slots,
                                             sinks, d ** -0.5)
        got = cpu_ops.sink_sparse_attention(q, kvp, tables, token_seq, positions, bs, window, entp, entry_slots,
                                            sinks, d ** -0.5, ds_mla=lay)
        assert got is not None and not got.isnan().any()
        assert (got.float() - want.float()).abs().max() < tol


def test_fp8_kv_bytes_per_token_real_configs():
    """V4-Flash's and V3's released configs on the meta device: what the engine would log, bf16 vs fp8."""
    from test_deepseek_v4 import V3, V4_FLASH

    from helpers import load_script

    report = load_script("kv_bytes_report")
    assert report.report_bytes(V4_FLASH, torch.bfloat16, 16) == 6880  # cache.py's docstring figure
    # entries at 584 B, indexer keys at 132 B: 21 CSA layers x (584 + 132) per 4 tokens + 20 HCA x 584 per 128 =
    # 3,850.25 -> 3,851 B/token, vLLM's ~3.85 KB
    assert report.report_bytes(V4_FLASH, torch.bfloat16, 16, "fp8") == -(-(21 * 716 * 32 + 20 * 584) // 128) == 3851
    assert report.report_bytes(V3, torch.bfloat16, 16, "fp8") == 61 * 576  # the latent in e4m3: half of bf16


def test_fp8_kv_halves_bytes_per_token(tmp_path):
    path = make_dense_checkpoint(tmp_path / "llama", vocab_size=128)
    a = LLM(str(path), dtype="bfloat16", num_kv_blocks=8)
    b = LLM(str(path), dtype="bfloat16", num_kv_blocks=8, kv_cache_dtype="fp8_e4m3")
    # 2 layers x K and V x 2 kv heads x 16 dims
    assert a.engine.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert b.engine.kv_bytes_per_token == 2 * 2 * 2 * 16


def test_kv_cache_dtype_errors(tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2'.*auto, fp8, fp8_e4m3"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")
    path = make_dense_checkpoint(tmp_path / "llama", vocab_size=128)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_ds_mla' is not supported by LlamaForCausalLM"):
        EngineArgs(model=str(path), kv_cache_dtype="fp8_ds_mla").create_engine_config()
    # an architecture whose cache writes have no fp8 path says so up front
    cfg = json.loads((path / "config.json").read_text())
    from openinfer.models import registry

    from openinfer.models.interface import CausalLM
    from openinfer.models.llama import LlamaForCausalLM

    class NoFp8(LlamaForCausalLM):  # the contract's default: the model's dtype only
        supported_kv_cache_dtypes = CausalLM.supported_kv_cache_dtypes

    registry.register_model("NoFp8ForTest", __name__, "NoFp8")
    globals()["NoFp8"] = NoFp8
    try:
        (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["NoFp8ForTest"]}))
        with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported by NoFp8ForTest; it supports "
                                             "auto"):
            EngineArgs(model=str(path), kv_cache_dtype="fp8").create_engine_config()
    finally:
        registry._MODELS.pop("NoFp8ForTest")
