"""DeepSeek-V4.1 with DeepInfer's KV numerics (``--kv-cache-dtype fp8 / fp4 / mxfp8``; layers/kv_mx.py,
models/deepseek_v41/cache.py KVNumerics): the record layouts and their bytes against DeepInfer's own definitions
(taken out of its source by tests/deepinfer_oracles.py), the e2m1 / e4m3 casts against bit-level references, the
bytes per token of V4.1-Flash against DeepInfer's per-entry figures, greedy agreement with the bf16-layout cache on
the tiny checkpoint, and bad values named."""
from __future__ import annotations

import pytest
import torch

from openinfer import LLM, SamplingParams
from openinfer.config import CacheConfig
from openinfer.engine_args import EngineArgs
from openinfer.layers.kv_mx import (E2M1_MAX, E4M3_MAX, E4M3_MIN_POSITIVE, FP4_AMAX_MARGIN, FP8_AMAX_MARGIN,
                                    e2m1_codes, fp4_index, fp4_main, mxfp8)
from openinfer.kv_cache_interface import KVGroupSpec, bytes_per_token
from openinfer.layers.mxfp4 import E2M1_VALUES
from openinfer.models.deepseek_v41.cache import KVNumerics, bytes_per_block, layout_summary
from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.deepseek_v41.reference import reference_logits
from tests import deepinfer_oracles as oracles
from tests.helpers import engine_model, load_script, random_prompts

CACHE_COMMON = f"{oracles.OPS}/cache_common.py"


def _deepinfer_formats():
    common = oracles.op("common", "FLOAT4_E2M1_MAX", "FLOAT8E4M3_MAX", "FLOAT8E4M3_MIN_POSITIVE",
                        "FP4_AMAX_MARGIN", "FP8_AMAX_MARGIN")
    formats = oracles.load(CACHE_COMMON, "KVCacheFormat", "V41_FORMAT", "V41_FP4_FORMAT", "FP4_INDEX_KV_FORMAT",
                           "MXFP8_INDEX_KV_FORMAT")
    return common, formats


def test_layouts_and_constants_are_deepinfers():
    common, di = _deepinfer_formats()
    assert (E2M1_MAX, E4M3_MAX, E4M3_MIN_POSITIVE, FP4_AMAX_MARGIN, FP8_AMAX_MARGIN) == (
        common.FLOAT4_E2M1_MAX, common.FLOAT8E4M3_MAX, common.FLOAT8E4M3_MIN_POSITIVE, common.FP4_AMAX_MARGIN,
        common.FP8_AMAX_MARGIN)
    for ours, theirs in ((mxfp8(512), di.V41_FORMAT), (fp4_main(512), di.V41_FP4_FORMAT),
                         (fp4_index(128), di.FP4_INDEX_KV_FORMAT), (mxfp8(128), di.MXFP8_INDEX_KV_FORMAT)):
        assert ours.row_bytes == theirs.bytes_per_token, theirs.note
        assert (ours.dim, ours.per_sf, "e2m1" if ours.fp4 else "e4m3", "e4m3" if ours.e4m3_scale else "ue8m0") == (
            theirs.quantized_elements, theirs.elements_per_sf, theirs.quantized_dtype, theirs.sf_format)
    assert (mxfp8(512).row_bytes, fp4_main(512).row_bytes, fp4_index(128).row_bytes) == (528, 288, 68)


def _e2m1_brute(x: torch.Tensor) -> torch.Tensor:
    """Nearest grid magnitude by distance, a tie to the even code; beyond 6 (and NaN) saturates; sign kept."""
    grid = torch.tensor(E2M1_VALUES[:8], dtype=torch.float64)
    mag = torch.nan_to_num(x.double().abs(), nan=6.0).clamp(max=6.0)
    dist = (mag[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    ties = dist == best
    code = torch.where(ties & (torch.arange(8) % 2 == 0), torch.arange(8), 99).amin(dim=1)
    code = torch.where(ties.sum(1) > 1, code, dist.argmin(dim=1))
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def test_e2m1_rounding_bit_level():
    grid = torch.tensor(E2M1_VALUES[:8])
    mids = (grid[1:] + grid[:-1]) / 2  # every tie: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, ..., 5 -> 4
    g = torch.Generator().manual_seed(0)
    x = torch.cat([grid, -grid, mids, -mids, mids + 1e-3, mids - 1e-3, torch.tensor([7.0, -100.0, -0.0]),
                   torch.randn(2000, generator=g) * 3])
    assert torch.equal(e2m1_codes(x), _e2m1_brute(x))
    assert e2m1_codes(torch.tensor([0.25, 0.75, 2.5, 5.0, -3.5])).tolist() == [0, 2, 4, 6, 8 | 6]
    assert e2m1_codes(torch.tensor([float("nan")])).item() & 7 == 7  # DeepInfer's reference: NaN -> 6


def test_fp4_main_scale_is_deepinfers_reference():
    """DeepInfer's ``ref_cast_from_bf16`` computes the e4m3 scale per 16 itself and hands it to TileKernels' cast
    (not DeepInfer's code: given a stand-in that records the scale); our stored scale bytes are that scale."""
    common, di = _deepinfer_formats()
    seen = {}

    def torch_cast(x, fmt, block_size, sf):
        seen.update(fmt=fmt, block_size=block_size, sf=sf)
        return torch.zeros(x.shape[0], x.shape[1] // 2, dtype=torch.int8)

    ref = oracles.load(CACHE_COMMON, "ref_cast_from_bf16", provide={
        "torch_cast": torch_cast, "quant": None, "FLOAT4_E2M1_MAX": common.FLOAT4_E2M1_MAX,
        "FLOAT8E4M3_MAX": common.FLOAT8E4M3_MAX, "FLOAT8E4M3_MIN_POSITIVE": common.FLOAT8E4M3_MIN_POSITIVE,
        "KVCacheTensors": oracles.load(CACHE_COMMON, "KVCacheTensors").KVCacheTensors})
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 512, generator=g) * torch.logspace(-4, 3, 7)[:, None]).bfloat16()
    x[3] = 0  # the floor: amax clamped at 2^-9 * 6
    x[5, :16] = 1e4  # the top: the scale saturates at 448
    out = ref.ref_cast_from_bf16(x, di.V41_FP4_FORMAT)
    assert seen["fmt"] == "e2m1" and seen["block_size"] == (1, 16)
    lay = fp4_main(512)
    rows = lay.pack(x)
    assert torch.equal(rows[:, 256:], out.sf_data.view(torch.uint8))
    # the data: e2m1 of x divided by the stored scale (bit-level reference above)
    sf = out.sf_data.float().repeat_interleave(16, dim=1)
    codes = _e2m1_brute((x.float() * (1.0 / sf)).flatten()).view(7, 256, 2)
    assert torch.equal(rows[:, :256], codes[..., 0] | (codes[..., 1] << 4))


@pytest.mark.parametrize("make", [mxfp8, fp4_index], ids=["mxfp8", "fp4-index"])
def test_ue8m0_formats_round_trip(make):
    g = torch.Generator().manual_seed(2)
    lay = make(128)
    x = torch.randn(2, 3, 128, generator=g) * torch.logspace(-3, 4, 6).view(2, 3, 1)
    x[1, 2] = 0
    rows = lay.pack(x)
    assert rows.shape == (2, 3, lay.row_bytes) and rows.dtype == torch.uint8
    back = lay.unpack(rows, torch.float32)
    groups = x.view(2, 3, 4, 32)
    amax = groups.abs().amax(-1)
    qmax, margin = (E2M1_MAX, FP4_AMAX_MARGIN) if lay.fp4 else (E4M3_MAX, FP8_AMAX_MARGIN)
    scale = (rows[..., lay.data_bytes:].to(torch.int32) << 23).view(torch.float32)
    want = amax.clamp(min=margin) / qmax
    assert ((scale >= want) & (scale < 2 * want)).all() and torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    q = groups / scale[..., None]
    if lay.fp4:
        expect = torch.tensor(E2M1_VALUES)[_e2m1_brute(q.flatten()).long()].view_as(q)
    else:
        expect = q.clamp(-448, 448).to(torch.float8_e4m3fn).float()  # torch's round-to-nearest-even cast
    assert torch.equal(back, (expect * scale[..., None]).view_as(x))
    assert torch.equal(back[1, 2], torch.zeros(128))


# ---- bytes per token ---------------------------------------------------------------------------------------------

def _v41_flash(**text) -> dict:
    from tests.test_deepseek_v41_ops import V41_FLASH, _generator

    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "text_config": {**V41_FLASH, **text}, "quantization_config": dict(_generator().QUANTIZATION)}


def _deepinfer_bytes_per_token(cfg: DeepseekV41Config, use_fp4: bool) -> float:
    """DeepInfer's whole-life bytes per token: its per-entry bytes (cache_engine ``_kv_bytes_per_token`` for the
    compressed KV, ``_get_qk_topk_bytes`` for the index keys, run from its source) over the layers that own a
    store (cache_engine ``process``: share-kv / share-index-K consumers hold none), an entry per ``ratio`` tokens."""
    _, di = _deepinfer_formats()
    attr = oracles.load("deepinfer/attrdict.py", "AttrDict").AttrDict
    engine = oracles.load("deepinfer/worker/cache_engine.py", "_kv_bytes_per_token", "_get_qk_topk_bytes",
                          provide={"V41_FORMAT": di.V41_FORMAT, "V41_FP4_FORMAT": di.V41_FP4_FORMAT,
                                   "AttrDict": attr})
    kv = engine._kv_bytes_per_token(cfg.head_dim - cfg.qk_rope_head_dim, cfg.qk_rope_head_dim, 16 if use_fp4 else 32,
                                    use_fp4)
    index_cfg = attr(attn_module_list=[attr(cfg=attr(attn_index=attr(index_head_dim=cfg.index_head_dim)))])
    idx = engine._get_qk_topk_bytes(index_cfg)
    topo, total = cfg.topology, 0.0
    for layer in range(cfg.num_hidden_layers):
        r = cfg.ratio(layer)
        total += (kv * (topo.kv_source[layer] == layer) + idx * (topo.index_k_source[layer] == layer)) / r if r else 0
    return total


def _bytes_per_token(hf: dict, kv_cache_dtype: str) -> int:
    """What the engine's start-up line says (kv_cache_spec's whole-life groups, bf16, block 16), from the config."""
    cfg = DeepseekV41Config.from_hf(hf)
    window, full = bytes_per_block(cfg, 16, 2, KVNumerics.build(cfg, kv_cache_dtype))
    return bytes_per_token([KVGroupSpec("full", full), KVGroupSpec("window", window, lookback_tokens=127)], 16)


def test_v41_flash_bytes_per_token_against_deepinfer():
    flash, no_fp4 = _v41_flash(), _v41_flash(use_fp4_sparse_kv=False)
    got = {kvd: _bytes_per_token(flash, kvd) for kvd in ("auto", "fp8", "fp4", "mxfp8")}
    fp4 = _deepinfer_bytes_per_token(DeepseekV41Config.from_hf(flash), True)
    mx = _deepinfer_bytes_per_token(DeepseekV41Config.from_hf(flash), False)
    # entries at 4 KV sources (C2 2, 8, 14; C1 20), index keys at the same 4 index-K sources
    assert (fp4, mx) == (3 * (288 + 68) / 2 + 288 + 68, 3 * (528 + 68) / 2 + 528 + 68) == (890, 1490)
    assert got == {"auto": 3200, "fp8": 890, "fp4": 890, "mxfp8": 1490}
    assert _bytes_per_token(no_fp4, "fp8") == 1490  # the config's switch, as DeepInfer
    # the script (and the model's kv_cache_spec behind it, told the kv_cache_dtype as the runner tells it)
    assert load_script("kv_bytes_report").report_bytes(flash, torch.bfloat16, 16, "fp8") == 890
    line = layout_summary(DeepseekV41Config.from_hf(flash), 2, KVNumerics.build(DeepseekV41Config.from_hf(flash),
                                                                                 "fp8"))
    assert "full group 890 (entries FP4 720, index_keys FP4 (UE8M0) 170)" in line, line
    assert "kv MXFP8 21120" in line, line  # 40 layers x 528 B within the window lookback
    auto = layout_summary(DeepseekV41Config.from_hf(flash), 2, KVNumerics())
    assert "use_fp4_sparse_kv (DeepInfer: FP4 compressed KV) is not applied under kv_cache_dtype=auto" in auto


# ---- the engine on the tiny checkpoint ---------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return load_script("make_deepseek_v41_checkpoint").make_checkpoint(tmp_path_factory.mktemp("v41") / "tiny",
                                                                        "tiny", seed=0)


def _generate(llm, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def _matches_reference(llm, prompts, outs) -> float:
    """Teacher-forced on the engine's tokens, the whole-sequence reference under the same numerics (every stored
    value and the indexer's queries through the format's round trip, reference.py) picks the same tokens; returns
    the largest logprob difference."""
    model = engine_model(llm)
    worst = 0.0
    for p, out in zip(prompts, outs):
        toks = out.outputs[0].token_ids
        lp = torch.log_softmax(reference_logits(model, p + toks, numerics=model.kv_numerics), -1)[len(p) - 1:-1]
        assert lp.argmax(dim=-1).tolist() == toks
        worst = max(worst, max(abs(out.outputs[0].logprobs[j][t] - float(lp[j, t])) for j, t in enumerate(toks)))
    return worst


def _teacher_forced(llm, prompts, base) -> tuple[float, float]:
    """Scored on the unquantised run's own tokens (prompt logprobs of prompt + its greedy tokens): (mean |logprob
    diff| of those tokens, share of their positions where this engine's argmax is the same token)."""
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, base)]
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    diffs, same = [], 0
    for p, s, b, o in zip(prompts, seqs, base, outs):
        for j in range(len(p), len(s)):
            got = o.prompt_logprobs[j]
            diffs.append(abs(got[s[j]] - b.outputs[0].logprobs[j - len(p)][s[j]]))
            same += max(got, key=got.get) == s[j]
    return sum(diffs) / len(diffs), same / len(diffs)


@pytest.mark.slow  # three engines on the tiny V4.1 (~4 s each) and the slow reference
def test_greedy_with_deepinfer_layouts(ckpt, capsys):
    from tests.test_fp8_kv import agreement

    prompts = random_prompts(3, [5, 40, 17, 70, 3, 33])
    kw = dict(dtype="float32", max_model_len=128, num_kv_blocks=64)
    base = _generate(LLM(str(ckpt), **kw), prompts)
    results = {}
    for kvd, entries in (("fp8", 64 // 2 + 64 // 16), ("mxfp8", 64 + 2)):
        llm = LLM(str(ckpt), kv_cache_dtype=kvd, **kw)
        cache = engine_model(llm).attention_layers()[2].cache  # the tiny model's C2 KV and index-K source
        assert (cache.kv.dtype, cache.kv.shape[-1], cache.entries.shape[-1], cache.index_keys.shape[-1]) == (
            torch.uint8, 64 + 2, entries, 16 + 1)  # MXFP8 window, FP4 / MXFP8 entries, FP4 index keys (dims 64, 32)
        forced = _teacher_forced(llm, prompts, base)
        out = _generate(llm, prompts)
        again = _generate(llm, prompts)  # prefix-cache hits read the packed blocks back: the same tokens
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in out]
        assert any(o.num_cached_tokens > 0 for o in again)
        worst = _matches_reference(llm, prompts[:3], out[:3]) if kvd == "fp8" else None
        results[kvd] = (*agreement(base, out), *forced, worst)
    with capsys.disabled():
        for kvd, (same, first, prefix, mean_lp, forced_lp, forced_same, worst) in results.items():
            print(f"\nV4.1 tiny, kv_cache_dtype={kvd} vs auto (fp32 stores): identical greedy tokens on {same} of "
                  f"{len(prompts)} prompts ({GREEDY.max_tokens} tokens each), first token on {first}, {prefix:.1f} "
                  f"tokens matched on average before a difference, mean |logprob diff| {mean_lp:.4f}; on auto's "
                  f"tokens: mean |logprob diff| {forced_lp:.3f}, same argmax at {forced_same:.0%} of positions"
                  + (f"; vs the reference under the same numerics: same tokens, logprobs within {worst:.1e}"
                     if worst is not None else ""))
    # The check of the packed path: the engine (paged writes, reads, prefix hits) is the reference under the same
    # numerics; the formats themselves are checked bit by bit above.
    assert results["fp8"][6] < 1e-3
    for *_, forced_lp, forced_same, _ in results.values():
        # Free-running agreement is low on this model (its first-token margins are 0.06-0.3 nats, the MXFP8
        # window alone flips 5 of 6 first tokens; bf16 stores flip 1) and reported only. Scored on auto's tokens
        # it separates: measured 0.57 nats / 42 % (fp8) and 0.60 / 39 % (mxfp8), against 2.26 / 1 % with every
        # packed read zeroed.
        assert forced_lp < 1.0 and forced_same > 0.25


def test_bad_values_named(ckpt, tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype='fp6' is not supported; choose one of auto, fp8, .*fp4, "
                                         "mxfp8"):
        CacheConfig(kv_cache_dtype="fp6")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_ds_mla' is not supported by DeepseekV41ForCausalLM; "
                                         "it supports auto, fp8, fp8_e4m3, fp4, mxfp8"):
        EngineArgs(model=str(ckpt), kv_cache_dtype="fp8_ds_mla").create_engine_config()
    with pytest.raises(ValueError, match="kv_cache_dtype='fp4' cannot be combined with DSpark drafting"):
        EngineArgs(model=str(ckpt), kv_cache_dtype="fp4",
                   speculative_config={"method": "mtp", "num_speculative_tokens": 2}).create_engine_config()
    with pytest.raises(ValueError, match="use_fp4_sparse_kv='yes' must be true or false"):
        DeepseekV41Config.from_hf(_v41_flash(use_fp4_sparse_kv="yes"))
    off = DeepseekV41Config.from_hf(_v41_flash(use_fp4_sparse_kv=False))
    assert KVNumerics.build(off, "fp8").entries.name == "MXFP8" and KVNumerics.build(off, "fp4").entries.name == "FP4"
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_ds_mla' is not supported by DeepSeek-V4.1"):
        KVNumerics.build(off, "fp8_ds_mla")
    with pytest.raises(ValueError, match="MXFP8 KV needs a row width divisible by 32, got 48"):
        mxfp8(48)


def test_fp8_linears_run_packed(ckpt, monkeypatch):
    """The checkpoint's FP8 linears (32x32 UE8M0 blocks) stay as shipped and run packed (V4's Fp8Weight and its
    C++ kernel), as DeepInfer runs FP8 GEMMs: the same greedy tokens as dequantised at load, logprobs within 1e-4
    (DeepInfer's MXFP8 activations are not emulated: the activations stay fp32 / bf16)."""
    from openinfer.layers.fp8 import Fp8Weight
    from openinfer.layers.linear import Linear

    prompts = random_prompts(4, [5, 40, 17])
    runs = {}
    for mode in ("packed", "dequantize"):
        monkeypatch.setenv("OPENINFER_FP8_WEIGHTS", mode)
        llm = LLM(str(ckpt), dtype="float32", max_model_len=128, num_kv_blocks=32)
        outs = _generate(llm, prompts)
        packed = {n for n, m in engine_model(llm).named_modules()
                  if isinstance(m, Linear) and isinstance(m._quant, Fp8Weight)}
        runs[mode] = ([o.outputs[0].token_ids for o in outs],
                      [[o.outputs[0].logprobs[j][t] for j, t in enumerate(o.outputs[0].token_ids)] for o in outs],
                      packed)
    toks, lps, packed = runs["packed"]
    assert runs["dequantize"][2] == set()
    for i in range(8):  # every layer's attention projections; o_a_proj is read as a grouped matrix: dequantised
        assert {f"model.layers.{i}.self_attn.{p}" for p in ("q_a_proj", "q_b_proj", "o_b_proj")} <= packed
        assert f"model.layers.{i}.self_attn.o_a_proj" not in packed
    assert toks == runs["dequantize"][0]
    assert max(abs(a - b) for x, y in zip(lps, runs["dequantize"][1]) for a, b in zip(x, y)) < 1e-4
