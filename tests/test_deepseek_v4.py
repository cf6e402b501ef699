"""DeepSeek-V4 in openinfer: parity with transformers' DeepseekV4ForCausalLM on a tiny random checkpoint
(4 layers SWA / HCA / CSA / HCA, window 16, CSA 4 / HCA 16, hash MoE on layer 0), through batching, chunked
prefill, prefix-cache hits and preemption; fast paths against plain references; config and name handling.

HF quirk this avoids on purpose: the lightning indexer scores are sums of ReLUs, so exact ties (all heads <= 0 ->
score 0) happen, and HF's ``torch.topk`` breaks them by tensor length, i.e. differently in prefill and decode
(spec §10). We break ties towards the lowest index; to compare with HF on a deterministic case the checkpoint
uses 16 indexer heads (a score is exactly 0 only when all 16 ReLUs are), while index_topk=8 < the up to 28
visible entries still makes the top-k selection matter.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from openinfer import LLM, SamplingParams
from openinfer.engine.request import Request
from openinfer.models.deepseek_v4.cache import StepIndex, coarse_ratio, layer_bytes_per_block, lookback_tokens
from openinfer.models.deepseek_v4.config import DeepseekV4Config
from openinfer.models.deepseek_v4.indexer import Indexer
from openinfer.models.deepseek_v4.hc import HyperConnection, fused_post_pre, hc_post
from openinfer.models.deepseek_v4.moe import DeepseekV4MoE
from openinfer.layers.deepseek_moe import RouterConfig, route
from openinfer.layers.linear import num_parameters
from openinfer.layers.moe import reference_experts, swiglu
from tests.helpers import engine_model, hf_greedy, kv_manager, load_script, random_prompts
from openinfer.config import AttentionBackend

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 32
LENGTHS = [3, 17, 33, 40, 52, 64, 75, 80]


def _generator():
    return load_script("make_deepseek_v4_checkpoint")


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    return random_prompts(seed, lengths)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return _generator().make_checkpoint(tmp_path_factory.mktemp("v4") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts(1, LENGTHS)


@pytest.fixture(scope="module")
def hf_ref(ckpt, prompts):
    return hf_greedy(ckpt, prompts, NEW_TOKENS)


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int = NEW_TOKENS):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _assert_matches(outs, ref) -> None:
    for i, (out, (toks, lps)) in enumerate(zip(outs, ref)):
        got = out.outputs[0].token_ids
        assert got == toks, f"prompt {i}: {got} != HF {toks}"
        diff = max(abs(out.outputs[0].logprobs[j][t] - lps[j]) for j, t in enumerate(got))
        assert diff < 1e-3, f"prompt {i}: logprob differs from HF by {diff}"


def test_parity_with_hf_one_batch(ckpt, prompts, hf_ref):
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128, num_kv_blocks=96)
    _assert_matches(_run(llm, prompts), hf_ref)
    model = engine_model(llm)  # the reported size is what is allocated, per group
    allocated = sum(getattr(a.cache, n).nbytes for a in model.attention_layers() for n in a.cache.names)
    blocks = llm.engine.num_kv_blocks
    assert blocks["full"] == 96 and blocks["window"] == 96  # window capped at the full group's count
    assert allocated == sum(g.bytes_per_block * blocks[g.name] for g in model.kv_cache_spec(16, torch.float32))
    assert all(a.cache.kv.shape[0] == blocks["window"] for a in model.attention_layers())
    assert (f"96 blocks of 16 + 96 window blocks, {llm.engine.kv_bytes_per_token} bytes/token steady state"
            in llm.engine.startup_message)


@pytest.mark.parametrize("block_size", [16, 8])  # 8: HCA entries (m = 16) in the coarse group
def test_reference_backend_matches_fast_path(ckpt, prompts, hf_ref, block_size):
    kw = dict(dtype="float32", max_model_len=128, num_kv_blocks=96, max_num_batched_tokens=64,
              block_size=block_size)
    fast = _run(LLM(str(ckpt), **kw), prompts[:4], 8)
    ref_llm = LLM(str(ckpt), attention_backend="reference", **kw)
    assert {a.backend for a in engine_model(ref_llm).attention_layers()} == {AttentionBackend.REFERENCE}
    ref = _run(ref_llm, prompts[:4], 8)
    for a, b in zip(fast, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for j, t in enumerate(a.outputs[0].token_ids):
            assert abs(a.outputs[0].logprobs[j][t] - b.outputs[0].logprobs[j][t]) < 1e-4
    _assert_matches(ref, [(t[:8], lp[:8]) for t, lp in hf_ref[:4]])


def test_chunked_prefill_and_prefix_cache_hits(ckpt, prompts, hf_ref):
    # block_size 8 < HCA ratio 16: a compressed entry's window spans two blocks, so this also checks that a
    # sequence diverging inside a window never writes into the shared block before it (the third batch would
    # then read a corrupted entry).
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=8,
              num_kv_blocks=160)
    # HCA entries (m = 16 = 2 blocks) live in the coarse group, one 16-token block per entry.
    kv = kv_manager(llm)
    assert [g.tokens_per_block for g in kv.groups] == [8, 8, 16] and [g.name for g in kv.groups] == [
        "full", "window", "coarse"]
    _assert_matches(_run(llm, prompts), hf_ref)
    g = torch.Generator().manual_seed(7)
    branches = [prompts[i][:cut] + torch.randint(6, 256, (9,), generator=g).tolist()
                for i, cut in ((7, 20), (6, 41), (5, 50), (4, 27))]
    outs = _run(llm, branches, 16)
    assert [o.num_cached_tokens for o in outs] == [16, 40, 48, 24]
    _assert_matches(outs, hf_greedy(ckpt, branches, 16))
    again = _run(llm, prompts[4:])
    # Every full prompt block was cached by the first batch (the last prompt token is never served from cache).
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 8 * 8 for p in prompts[4:]]
    _assert_matches(again, hf_ref[4:])
    assert _all_blocks_free(llm)


def test_preemption_recomputes_identically(ckpt, prompts, hf_ref):
    # The four longest prompts need 4 x 7 blocks of 16 at the end; 12 blocks force recompute-preemption.
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128, num_kv_blocks=12, max_num_batched_tokens=64)
    _assert_matches(_run(llm, prompts[4:]), hf_ref[4:])
    assert llm.engine.stats().num_preemptions > 0
    assert _all_blocks_free(llm)


def _all_blocks_free(llm: LLM) -> bool:
    return kv_manager(llm).all_free()  # full, window and (block_size < HCA ratio) coarse pools


def test_window_blocks_are_released_during_decode_and_still_serve_prefix_hits(ckpt, prompts):
    """A long generation holds at most ceil(lookback/bs) + 2 window blocks; the ones it released keep their
    hashes, so a later request sharing its prompt + output gets an exact hit; once some of them are evicted the
    hit is shortened to where the window pool still has the blocks. Tokens match HF in every case."""
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=16,
              num_kv_blocks=64)
    eng, kv = llm.engine, kv_manager(llm)
    window = kv.groups[1]
    lookback = window.lookback_tokens
    assert lookback == 15  # window 16 (reads 15 back), HCA m=16 (15 back), CSA m=4 overlapped (7 back)
    bound = -(-lookback // 8) + 2
    sp = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    eng.add_request("long", {"prompt_token_ids": prompts[3]}, sp)  # 40 prompt + 70 generated tokens
    held, out = [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        if "long" in window.tables:
            held.append(window.num_held("long"))
            computed = eng.core.scheduler.requests["long"].num_computed_tokens
            released = window.tables["long"][:max(0, computed - lookback) // 8]
            assert released == [None] * len(released)
    assert max(held) <= bound and len(window.tables) == 0 and _all_blocks_free(llm)
    assert held[-1] <= bound and len(held) >= 60
    history = prompts[3] + out.outputs[0].token_ids
    g = torch.Generator().manual_seed(11)
    exact = history[:90] + torch.randint(6, 256, (5,), generator=g).tolist()
    # Exact: the hit ends at block 11 (88 tokens); its window blocks 9, 10 were released ~20 tokens before
    # "long" finished and are still cached.
    short_prompt = history[:20] + torch.randint(6, 256, (3,), generator=g).tolist()
    outs = _run(llm, [exact], 8)
    assert outs[0].num_cached_tokens == 88
    _assert_matches(outs, hf_greedy(ckpt, [exact], 8))
    assert _all_blocks_free(llm)
    # Refresh window blocks 0, 1 (a hit at 16 tokens reads rows 1..15), then evict every older free window
    # block, which takes blocks 2..10 of "long" with it.
    assert _run(llm, [short_prompt], 2)[0].num_cached_tokens == 16
    probe = Request("probe", history[:41], SamplingParams(max_tokens=1), 128)
    keys = kv._block_keys(probe, 5)
    win = [window.pool.get_cached_block(k) for k in keys]
    free = window.pool.free_block_ids()
    cut = max(free.index(b.block_id) for b in win[2:]) + 1
    assert all(free.index(b.block_id) >= cut for b in win[:2])
    stolen = window.pool.allocate(cut)
    later = history[:41] + torch.randint(6, 256, (4,), generator=g).tolist()
    hits, n = kv.get_computed_blocks(Request("peek", later, SamplingParams(max_tokens=1), 128))
    assert n == 16  # the full group still has 5 blocks, the window group only what h = 2 needs
    window.pool.release(stolen)
    outs = _run(llm, [later], 8)
    assert outs[0].num_cached_tokens == 16
    _assert_matches(outs, hf_greedy(ckpt, [later], 8))
    assert _all_blocks_free(llm)


def test_fused_hc_post_pre_matches_plain():
    torch.manual_seed(0)
    n, d, t = 4, 32, 5
    nxt = HyperConnection(n, d, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
    with torch.no_grad():
        nxt.fn.normal_(0, 0.1), nxt.base.normal_(0, 0.5), nxt.scale.normal_(1, 0.3)
    X, y = torch.randn(t, n, d), torch.randn(t, d)
    post = 2 * torch.sigmoid(torch.randn(t, n))
    comb = torch.softmax(torch.randn(t, n, n), -1)
    new, x_in, p, c = fused_post_pre(y, X, post, comb, nxt)
    plain = hc_post(y, X, post, comb)
    want = nxt(plain)
    torch.testing.assert_close(new, plain)
    for got, exp in zip((x_in, p, c), want):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c.sum(-1), torch.ones(t, n), atol=1e-3, rtol=0)  # doubly stochastic
    torch.testing.assert_close(c.sum(-2), torch.ones(t, n), atol=1e-3, rtol=0)


def _tiny_cfg(**kw) -> dict:
    base = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
        qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=4,
        compress_ratios=[0, 4, 0], num_nextn_predict_layers=1, index_n_heads=2, index_head_dim=8, index_topk=2,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, moe_intermediate_size=16,
        scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, num_hash_layers=1, swiglu_limit=10.0,
        hc_mult=4, rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 64})
    base.update(kw)
    return base


def _plain_scores(logits: list[float], scoring_func: str) -> list[float]:
    if scoring_func == "sqrtsoftplus":
        return [math.sqrt(math.log1p(math.exp(v))) for v in logits]
    if scoring_func == "sigmoid":
        return [1 / (1 + math.exp(-v)) for v in logits]
    total = sum(math.exp(v) for v in logits)
    return [math.exp(v) / total for v in logits]


def reference_route(gate, x: torch.Tensor, input_ids: torch.Tensor):
    """Token by token in plain Python: hash table or biased top-k (ties -> lowest id); weights from scores."""
    cfg = gate.cfg
    weights, ids = [], []
    for i in range(x.shape[0]):
        s = _plain_scores([float(v) for v in gate.weight.float() @ x[i].float()], cfg.scoring_func)
        if gate.is_hash:
            chosen = [int(e) for e in gate.tid2eid[int(input_ids[i])]]
        else:
            bias = gate.e_score_correction_bias.tolist()
            chosen = sorted(range(len(s)), key=lambda e: (-(s[e] + bias[e]), e))[:cfg.num_experts_per_tok]
        w = [s[e] for e in chosen]
        total = sum(w) + 1e-20 if cfg.norm_topk_prob else 1.0
        weights.append([v / total * cfg.routed_scaling_factor for v in w])
        ids.append(chosen)
    return torch.tensor(weights), torch.tensor(ids)


@pytest.mark.parametrize("layer_idx", [0, 1])
def test_moe_routing_matches_plain_reference(layer_idx):
    cfg = DeepseekV4Config.from_hf(_tiny_cfg())
    torch.manual_seed(layer_idx)
    moe = DeepseekV4MoE(cfg, layer_idx)
    assert moe.gate.is_hash == (layer_idx == 0)
    assert hasattr(moe.gate, "e_score_correction_bias") != moe.gate.is_hash  # hash layers carry no bias
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        if moe.gate.is_hash:
            moe.gate.tid2eid.copy_(torch.stack([torch.randperm(8)[:3] for _ in range(64)]))
        else:  # a bias large enough to change the selection against the raw scores
            moe.gate.e_score_correction_bias.normal_(0, 0.5)
    x, ids = torch.randn(6, 32), torch.randint(0, 64, (6,))
    w, e = moe.gate(x, ids)
    rw, re_ = reference_route(moe.gate, x, ids)
    assert torch.equal(e, re_)
    torch.testing.assert_close(w, rw.float(), rtol=1e-5, atol=1e-6)
    if not moe.gate.is_hash:
        raw = torch.nn.functional.softplus(x @ moe.gate.weight.t()).sqrt().topk(3).indices
        assert not all(set(a.tolist()) == set(b.tolist()) for a, b in zip(raw, e)), "bias never mattered"
    shared = moe.shared_experts.down_proj(swiglu(moe.shared_experts.gate_up_proj(x), 10.0))
    want = reference_experts(x, moe.experts.w13_weight, moe.experts.w2_weight, rw, re_, 10.0) + shared
    torch.testing.assert_close(moe(x, ids), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_route_hash_path_matches_plain_reference(scoring_func):
    """route(hash_ids=...): the table alone selects (group limits do not apply), the scores weight,
    renormalised and scaled; the same rows through the top-k path pick differently, so the table did matter."""
    cfg = RouterConfig(n_routed_experts=16, num_experts_per_tok=4, scoring_func=scoring_func, n_group=4,
                       topk_group=1, routed_scaling_factor=1.5)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 16, generator=g)
    table = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(7)])  # spans all four groups
    w, e = route(logits, cfg, hash_ids=table.int())
    assert e.dtype == torch.long and torch.equal(e, table)
    for row, chosen, got in zip(logits.tolist(), table.tolist(), w.tolist()):
        s = _plain_scores(row, scoring_func)
        want = [s[c] / (sum(s[c] for c in chosen) + 1e-20) * 1.5 for c in chosen]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert not torch.equal(route(logits, cfg)[1].sort(-1).values, table.sort(-1).values)
    with pytest.raises(ValueError, match="no e_score_correction_bias"):
        route(logits, cfg, torch.zeros(16), hash_ids=table)
    with pytest.raises(ValueError, match="hash_ids has shape"):
        route(logits, cfg, hash_ids=table[:, :3])
    gate = DeepseekV4MoE(DeepseekV4Config.from_hf(_tiny_cfg()), 0).gate
    with pytest.raises(ValueError, match="token ids"):
        gate(torch.randn(2, 32))


@pytest.mark.parametrize("field, change", [
    ("compress_ratios", {"compress_ratios": [0, 4]}),
    ("hc_mult", {"hc_mult": None}),
    ("index_topk", {"index_topk": 0}),
    ("scoring_func", {"scoring_func": "relu"}),
])
def test_malformed_config_is_rejected_naming_the_field(field, change):
    cfg = _tiny_cfg(**change)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ValueError, match=field):
        DeepseekV4Config.from_hf(cfg)


V4_FLASH = dict(
    architectures=["DeepseekV4ForCausalLM"], vocab_size=129280, hidden_size=4096, num_hidden_layers=43,
    num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
    sliding_window=128, compress_ratios=[0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)] + [0],
    compress_rope_theta=160000, rope_theta=10000, max_position_embeddings=1048576,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                  "beta_slow": 1},
    index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=6, moe_intermediate_size=2048, scoring_func="sqrtsoftplus", topk_method="noaux_tc",
    norm_topk_prob=True, routed_scaling_factor=1.5, num_hash_layers=3, swiglu_limit=10.0, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, num_nextn_predict_layers=1)

# DeepSeek-V3's released config.json, the fields the model reads (spec §6).
V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, first_k_dense_replace=3,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
    norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc",
    max_position_embeddings=163840, rms_norm_eps=1e-6,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, rope_theta=10000)


def _kv_report(cfg: dict):
    """(groups, summary line) exactly as the engine reports them at start-up, bf16, block 16."""
    spec = importlib.util.spec_from_file_location("kv_report", ROOT / "scripts" / "kv_bytes_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.report(cfg, torch.bfloat16, 16)


def test_v4_flash_config_and_cache_size():
    """V4-Flash's released config.json (spec §2, DeepSeek style): schedule, RoPE, and this layout's KV size,
    about 10x smaller per token than V3's at the real configs (see cache.py for the arithmetic)."""
    cfg = DeepseekV4Config.from_hf(V4_FLASH)
    kinds = cfg.layer_types[:43]
    assert (kinds.count("compressed_sparse_attention"), kinds.count("heavily_compressed_attention")) == (21, 20)
    assert cfg.layer_types[43] == "sliding_attention" and not cfg.is_hash_layer(43) and cfg.is_hash_layer(2)
    assert cfg.main_rope.factor is None and cfg.compress_rope.factor == 16 and cfg.compress_rope.theta == 160000
    window, full, coarse = (sum(x) for x in zip(*(layer_bytes_per_block(cfg, i, 16, 2) for i in range(43))))
    assert full // 16 == 6720  # CSA entries + indexer keys: 21 x 2*(512+128) per 4 tokens
    assert coarse == 20 * 1024 and coarse_ratio(cfg, 16) == 128  # one HCA entry per layer per 128 tokens
    assert window // 16 == 192512 and lookback_tokens(cfg) == 127  # 21 x 6144 + 20 x 3072 + 2 x 1024
    v4 = _kv_report(V4_FLASH)
    v3 = _kv_report(V3)
    assert v4 == ("6880 bytes/token steady state + window group 192512 bytes/token over a 127-token lookback = "
                  "30801920 bytes per running sequence"), v4  # 6720 + 160; 10 blocks of 16 x 192512
    assert v3 == "70272 bytes/token"  # 61 layers x (512 + 64) x 2 B, the same code path as any dense model
    assert 70272 / 6880 > 10


def test_indexer_breaks_ties_towards_lowest_entry():
    """All-zero indexer queries make every score ReLU(0) = 0: the choice must be the lowest visible entries."""
    idx = Indexer(hidden_size=8, q_lora_rank=4, n_heads=2, head_dim=8, ratio=4, topk=3, eps=1e-6)
    with torch.no_grad():
        idx.q_b_proj.weight.zero_(), idx.weights_proj.weight.fill_(1.0)
    step = StepIndex(tables=torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]), token_seq=torch.tensor([0, 1, 1]),
                     positions=torch.tensor([40, 7, 9]), block_size=16)
    entries = torch.randn(8 * 4, 8)
    cos, sin = torch.ones(3, 4), torch.zeros(3, 4)
    chosen = idx.select(torch.randn(3, 4), torch.randn(3, 8), step, entries, 4, cos, sin)
    assert chosen.tolist() == [[0, 1, 2], [0, 1, -1], [0, 1, -1]]


def test_step_index_shares_its_per_step_indices_across_layers():
    """Two compressors of one ratio (a CSA layer's main and indexer ones, or two layers) pool from the same slots:
    the second reuses the first's plan, and each writes exactly what a fresh plan gives; a slice is built once."""
    from openinfer.models.deepseek_v4.compressor import Compressor
    from openinfer.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    comps = [Compressor(hidden_size=8, dim=4, ratio=4, overlap=True, eps=1e-6) for _ in range(2)]
    for c in comps:
        for p in c.parameters():
            p.data.normal_()
    rotary = RotaryEmbedding(2, {"rope_theta": 10000.0, "rope_type": "default"})

    def make_step():
        return StepIndex(tables=torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]), token_seq=torch.tensor([0, 1, 1]),
                         positions=torch.tensor([11, 6, 7]), block_size=4)
    store = torch.randn(8 * 4, comps[0].row_width)
    step = make_step()
    shared = [torch.zeros(8 * 4, 4) for _ in comps]
    for c, out in zip(comps, shared):
        c.emit(step, store, out, 4, rotary, torch.float32)
    assert [k for k in step._memo if k[0] == "compress"] == [("compress", 4, True, 4)]
    for c, out in zip(comps, shared):  # each alone, on a fresh step: the same rows in the same slots
        fresh = torch.zeros(8 * 4, 4)
        c.emit(make_step(), store, fresh, 4, rotary, torch.float32)
        assert torch.equal(out, fresh) and fresh.abs().sum() > 0
    assert step.slice(0, 3) is step and step.slice(1, 3) is step.slice(1, 3)
    assert step.slice(1, 3).positions.tolist() == [6, 7] and step.max_position == 11


def test_both_config_styles_parse_alike(ckpt):
    hf_style = DeepseekV4Config.from_hf(json.loads((ckpt / "config.json").read_text()))
    ds = _deepseek_style_config(json.loads((ckpt / "config.json").read_text()))
    assert DeepseekV4Config.from_hf(ds) == hf_style
    assert hf_style.layer_types[-1] == "sliding_attention" and hf_style.compress_ratios == (0, 16, 4, 16, 0)
    assert hf_style.compress_rope.factor == 4.0 and hf_style.main_rope.factor is None


def _deepseek_style_config(hf: dict) -> dict:
    ds = {k: v for k, v in hf.items() if k not in (
        "layer_types", "compress_rates", "mlp_layer_types", "rope_parameters", "partial_rotary_factor")}
    rates = hf["compress_rates"]
    ds["compress_ratios"] = [rates.get(t, 0) for t in hf["layer_types"]] + [0] * hf["num_nextn_predict_layers"]
    ds["num_hash_layers"] = hf["mlp_layer_types"].count("hash_moe")
    ds["qk_rope_head_dim"] = int(hf["head_dim"] * hf["partial_rotary_factor"])
    comp = hf["rope_parameters"]["compress"]
    ds["rope_scaling"] = {"type": "yarn", "factor": comp["factor"], "beta_fast": comp["beta_fast"],
                          "beta_slow": comp["beta_slow"],
                          "original_max_position_embeddings": comp["original_max_position_embeddings"]}
    ds["compress_rope_theta"] = comp["rope_theta"]
    return ds


def write_release_with_mtp(ckpt: Path, ds_dir: Path) -> dict[str, torch.Tensor]:
    """``ckpt``'s weights in DeepSeek's release layout (unprefixed names, compress_ratios config) plus a random
    mtp.0 block (layer 0's shapes: sliding window, non-hash gate, its own heads); returns the tensors."""
    sd = load_file(str(ckpt / "model.safetensors"))
    out = {}
    for name, t in sd.items():
        name = name.removeprefix("model.")
        name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
        out[name.replace("hc_head.hc_", "hc_head_")] = t
    h, n = sd["model.embed_tokens.weight"].shape[1], 4
    g = torch.Generator().manual_seed(3)
    for name, t in list(out.items()):  # MTP block: layer 0's shapes (SWA), non-hash gate, plus its own heads
        if name.startswith("layers.0.") and not name.endswith("tid2eid"):
            out["mtp.0." + name[len("layers.0."):]] = torch.randn(t.shape, generator=g)
    out["mtp.0.ffn.gate.bias"] = torch.randn(8, generator=g)
    for leaf, shape in {"e_proj.weight": (h, h), "h_proj.weight": (h, h), "enorm.weight": (h,),
                        "hnorm.weight": (h,), "norm.weight": (h,), "hc_head_fn": (n, n * h),
                        "hc_head_base": (n,), "hc_head_scale": (1,)}.items():
        out[f"mtp.0.{leaf}"] = torch.randn(shape, generator=g)
    ds_dir.mkdir()
    save_file(out, str(ds_dir / "model.safetensors"))
    cfg = _deepseek_style_config(json.loads((ckpt / "config.json").read_text()))
    (ds_dir / "config.json").write_text(json.dumps(cfg))
    for f in ckpt.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (ds_dir / f.name).write_bytes(f.read_bytes())
    return out


def test_deepseek_release_names_and_mtp(ckpt, prompts, hf_ref, tmp_path, caplog):
    """The same weights in DeepSeek's release layout (unprefixed names, compress_ratios config, an mtp.0 block)
    give the same tokens; the MTP block loads into ``model.mtp``; without it a single log line says so."""
    with caplog.at_level(logging.INFO, logger="openinfer.models.deepseek_v4.loading"):
        hf_llm = LLM(str(ckpt), dtype="float32", max_model_len=128, num_kv_blocks=32)
    assert engine_model(hf_llm).mtp is None
    assert sum("no MTP weights" in r.message for r in caplog.records) == 1

    ds_dir = tmp_path / "release"
    out = write_release_with_mtp(ckpt, ds_dir)
    # tokenizer from the HF-style dir: transformers' AutoTokenizer parses config.json, and its DeepseekV4Config
    # only maps compress_ratios values 0/4/128 (this tiny model uses 16).
    llm = LLM(str(ds_dir), tokenizer=str(ckpt), dtype="float32", max_model_len=128, num_kv_blocks=32)
    model = engine_model(llm)
    assert model.mtp is not None
    torch.testing.assert_close(model.mtp[0].self_attn.q_a_proj.dense_weight(), out["mtp.0.attn.wq_a.weight"])
    w3 = out["mtp.0.ffn.experts.3.w3.weight"]
    torch.testing.assert_close(model.mtp[0].mlp.experts.dense_weights()[0][3, 64:], w3)
    _assert_matches(_run(llm, prompts[:2], 8), [(t[:8], lp[:8]) for t, lp in hf_ref[:2]])


def test_generator_writes_loadable_checkpoints(ckpt, tmp_path):
    """The tiny checkpoint every other test loads comes from the generator too; here the bench size."""
    assert (ckpt / "config.json").is_file() and (ckpt / "tokenizer.json").is_file()
    gen = _generator()
    bench = gen.make_checkpoint(tmp_path / "bench", "bench", seed=0, dtype=torch.bfloat16)
    cfg = json.loads((bench / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"]
    llm = LLM(str(bench), dtype="bfloat16", num_kv_blocks=16, max_num_batched_tokens=64)
    n = num_parameters(engine_model(llm))
    assert 100e6 <= n <= 300e6, n
    out = _run(llm, [list(range(6, 40))], 4)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.kv_bytes_per_token > 0
