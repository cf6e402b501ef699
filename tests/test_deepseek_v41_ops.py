"""DeepSeek-V4.1 building blocks against plain torch / numpy references written from DeepInfer's definitions
(random inputs), and config / topology validation (malformed fields raise ValueError naming them)."""
from __future__ import annotations

import copy

import pytest
import torch

from openinfer.models.deepseek_v4.hc import HyperConnection
from openinfer.models.deepseek_v41 import reference
from openinfer.models.deepseek_v41.compression import Compressor
from openinfer.models.deepseek_v41.config import DeepseekV41Config, EngramConfig
from openinfer.models.deepseek_v41.engram import Engram, table_sizes
from openinfer.models.deepseek_v41.hc import ShiftedHyperConnection, apply_pre
from openinfer.models.deepseek_v41.indexer import Indexer, candidate_blocks, candidate_mask, select_topk
from openinfer.models.deepseek_v41.topology import source_map

from tests.test_deepseek_v41 import _generator


def _text() -> dict:
    gen = _generator()
    return {**gen.COMMON, **gen.SIZES["tiny"]}


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))


@pytest.mark.parametrize("ratio", [1, 2])
def test_compressor_matches_plain_pooling(ratio):
    torch.manual_seed(0)
    comp = Compressor(32, 16, ratio, 1e-6)
    _randomize(comp, ratio)
    h = torch.randn(10, 32)
    want = reference.compress(comp, h)
    rows = comp.rows(h).view(10 // ratio, ratio, -1)
    assert want.shape == (10 // ratio, 16)
    torch.testing.assert_close(comp.pool(rows), want, atol=1e-5, rtol=1e-5)
    if ratio == 2:  # the gate matters: an equal-weight pool differs
        plain = torch.nn.functional.rms_norm(comp.kv_proj(h).view(5, 2, 16).mean(1), (16,), comp.kv_norm.weight, 1e-6)
        assert (plain - want).abs().max() > 1e-3


def _python_topk(scores, visible, k, allowed=None):
    out = []
    for t, row in enumerate(scores.tolist()):
        pool = [w for w in range(visible[t]) if allowed is None or allowed[t][w]]
        out.append(sorted(pool, key=lambda w: (-row[w], w))[:k])
    return out


def test_index_scores_topk_and_candidate_blocks_match_python():
    torch.manual_seed(1)
    idx = Indexer(24, 16, 20, n_heads=4, head_dim=8, owns_keys=True, eps=1e-6)
    _randomize(idx, 3)
    t, w = 6, 23
    q = torch.randn(t, 4, 8)
    head_w = torch.randn(t, 4)
    keys = torch.randn(t, w, 8)
    scores = idx.score(q, head_w, keys)
    plain = torch.tensor([[sum(float(head_w[i, h] * torch.relu(q[i, h] @ keys[i, j]) * 8 ** -0.5) for h in range(4))
                           for j in range(w)] for i in range(t)])
    torch.testing.assert_close(scores, plain, atol=1e-5, rtol=1e-5)
    scores = scores.round(decimals=1)  # force ties: the lowest entry wins
    visible = torch.tensor([0, 1, 5, 12, 23, 17])
    chosen = select_topk(scores, visible, 4)
    want = _python_topk(scores, visible.tolist(), 4)
    assert [[c for c in row if c >= 0] for row in chosen.tolist()] == want
    blocks = candidate_blocks(scores, visible, 3, 2)
    for i in range(t):
        best = {}
        for j in range(int(visible[i])):
            best[j // 3] = max(best.get(j // 3, float("-inf")), float(scores[i, j]))
        if best:  # the newest block always first (DeepInfer scores it +inf)
            best[(int(visible[i]) - 1) // 3] = float("inf")
        assert [b for b in blocks[i].tolist() if b >= 0] == sorted(best, key=lambda b: (-best[b], b))[:2]
    allowed = candidate_mask(blocks, w, 3)
    restricted = select_topk(scores, visible, 4, allowed)
    want = _python_topk(scores, visible.tolist(), 4, allowed.tolist())
    assert [[c for c in row if c >= 0] for row in restricted.tolist()] == want
    assert restricted.tolist() != chosen.tolist()  # the restriction changes the choice


def test_shifted_hc_mixes_are_v4s_and_the_pre_is_shifted():
    torch.manual_seed(2)
    hc = ShiftedHyperConnection(4, 16, 20, 1e-6, 1e-6)
    _randomize(hc, 4)
    v4 = HyperConnection(4, 16, 20, 1e-6, 1e-6)
    v4.load_state_dict(hc.state_dict())
    X = torch.randn(5, 4, 16)
    pre, post, comb = hc.mixes(X)
    x_in, v4_post, v4_comb = v4._activate_torch(
        torch.nn.functional.rms_norm(X.reshape(5, -1), (64,), None, 1e-6) @ v4.fn.t(), X)
    torch.testing.assert_close(apply_pre(pre, X), x_in)
    torch.testing.assert_close(post, v4_post)
    torch.testing.assert_close(comb, v4_comb)
    rpre, rpost, rcomb = reference.mixes(hc, X)
    torch.testing.assert_close(pre, rpre)
    torch.testing.assert_close(comb, rcomb)
    y = torch.randn(5, 16)
    from openinfer.models.deepseek_v41.hc import hc_post
    torch.testing.assert_close(hc_post(y, X, post, comb), reference.post_mix(y, X, post, comb), atol=1e-5,
                               rtol=1e-5)


def _engram(seed: int = 0) -> tuple[Engram, EngramConfig]:
    cfg = EngramConfig(layer_ids=(1, 3), max_ngram_size=4, n_heads=2, head_dim=8, vocab_size=31, pad_token_id=2,
                       tokenizer_vocab_size=100)
    sizes = table_sizes(cfg)
    e = Engram(cfg, 3, 16, 4, 1e-6, sizes[3])
    _randomize(e, seed)
    return e, cfg


def test_engram_tables_are_distinct_primes_across_layers():
    _, cfg = _engram()
    sizes = table_sizes(cfg)
    flat = sizes[1] + sizes[3]
    assert len(set(flat)) == len(flat) == 2 * 3 * 2
    assert all(s >= 31 for s in flat) and sizes[1][0] == 31 and sizes[1][1] == 37  # next prime >= vocab, then up


def test_engram_hash_and_gate_match_numpy_reference():
    e, cfg = _engram()
    ids = torch.randint(0, 100, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    back = torch.arange(13)[:, None] - torch.arange(4)
    history = torch.where(back >= 0, torch.tensor(ids)[back.clamp(min=0)], cfg.pad_token_id)
    got = e.hashes(history)
    want = torch.from_numpy(reference.engram_hashes(e, ids, cfg.pad_token_id))
    assert torch.equal(got, want)
    assert (got < e.offsets + e.sizes).all() and (got >= e.offsets).all()
    # huge ids exercise int64 wrap-around: torch and numpy must agree bit for bit
    big = [2 ** 40 + i for i in range(13)]
    hb = torch.where(back >= 0, torch.tensor(big)[back.clamp(min=0)], cfg.pad_token_id)
    assert torch.equal(e.hashes(hb), torch.from_numpy(reference.engram_hashes(e, big, cfg.pad_token_id)))
    X = torch.randn(13, 4, 16)
    torch.testing.assert_close(e(X, history), reference.engram_gate(e, X, ids, cfg.pad_token_id), atol=1e-5,
                               rtol=1e-5)


def test_engram_tokenizer_compression(tmp_path):
    """DeepInfer's CompressedVocabulary on the char tokenizer: case and whitespace variants share an id."""
    from openinfer.models.deepseek_v41.engram import compressed_vocabulary
    from openinfer.utils.char_tokenizer import write_char_tokenizer
    from tokenizers import Tokenizer

    write_char_tokenizer(tmp_path, 256)
    file = str(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="engram_compressed_vocab_size=200, but .* compresses to 228 tokens"):
        compressed_vocabulary(file, 200)
    table = compressed_vocabulary(file, 228)
    tok = Tokenizer.from_file(file)
    a, upper_a, b, space, tab = (tok.token_to_id(c) for c in ("a", "A", "b", " ", "\t"))
    assert table[a] == table[upper_a] != table[b] and table[space] == table[tab]
    assert sorted(set(table.tolist())) == list(range(228))  # dense, first-seen order


def test_source_maps():
    assert source_map([2, 8], 12, "kv_source_layer_ids") == (0, 1, 2, 2, 2, 2, 2, 2, 8, 8, 8, 8)
    with pytest.raises(ValueError, match="kv_source_layer_ids holds unknown layer ids \\[12\\]"):
        source_map([2, 12], 12, "kv_source_layer_ids")


def _cfg(**changes) -> dict:
    text = copy.deepcopy(_text())
    text.update(changes)
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text,
            "quantization_config": dict(_generator().QUANTIZATION), "_checkpoint_dir": "/unused"}


@pytest.mark.parametrize("size", ["tiny", "bench"])
def test_generator_configs_parse(size):
    gen = _generator()
    text = {**gen.COMMON, **gen.SIZES[size]}
    cfg = DeepseekV41Config.from_hf({"architectures": ["DeepseekV41ForCausalLM"], "text_config": text,
                                     "quantization_config": dict(gen.QUANTIZATION), "_checkpoint_dir": "/unused"})
    assert cfg.num_hidden_layers == 8 and cfg.dspark is not None


def test_tiny_config_parses():
    cfg = DeepseekV41Config.from_hf(_cfg())
    topo = cfg.topology
    assert topo.kv_source == (0, 1, 2, 2, 2, 5, 5, 7) and topo.index_source == (0, 1, 2, 2, 4, 5, 5, 7)
    assert topo.index_k_source == topo.kv_source and topo.n_prefill_layer == 5
    assert [topo.uses_candidates(i) for i in range(8)] == [False] * 7 + [True]
    assert cfg.fp8_block == (32, 32) and cfg.expert_dtype == "fp4" and cfg.engram.layer_ids == (1, 3)


@pytest.mark.parametrize("changes, message", [
    (dict(compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1]), "compress_ratios has 8 entries, expected num_hidden_layers "
                                                     "\\+ num_nextn_predict_layers = 8 \\+ 1 = 9"),
    (dict(compress_ratios=[0, 0, 4, 2, 2, 1, 1, 1, 0]), "compress_ratios holds \\[4\\]"),
    (dict(kv_source_layer_ids=[2, 5, 9]), "kv_source_layer_ids holds unknown layer ids \\[9\\]"),
    (dict(index_source_layer_ids=[2, 4, 5, 7, -1]), "index_source_layer_ids holds unknown layer ids \\[-1\\]"),
    (dict(kv_source_layer_ids=[2, 4]), "kv_source_layer_ids: layer 5 \\(compress ratio 1\\) reads source layer 4"),
    (dict(index_source_layer_ids=[2, 5, 7], kv_source_layer_ids=[2, 4, 5, 7]),
     "index_source_layer_ids: layer 4 reads source 2, which lies in another index_k_source_layer_ids segment"),
    (dict(candidate_source_layer_id=6), "candidate_source_layer_id=6 must be one of index_source_layer_ids"),
    (dict(candidate_topk_blocks=1), "candidate_topk_blocks \\* candidate_block_size = 2 < index_topk=4"),
    (dict(engram_layer_ids=[1, 8]), "engram_layer_ids holds unknown layer ids \\[8\\]"),
    (dict(engram_n_heads=None), "engram_n_heads must be a positive int"),
    (dict(engram_pad_token_id=None), "engram_pad_token_id=None"),
    (dict(engram_compressed_vocab_size=-3), "engram_compressed_vocab_size=-3"),
    (dict(dspark_target_layer_ids=[5, 6, 8]), "dspark_target_layer_ids"),
    (dict(num_hash_layers=3), "num_hash_layers"),
    (dict(vision_config={"hidden_size": 1024}), "vision_config"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_malformed_config_names_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        DeepseekV41Config.from_hf(_cfg(**changes))


def test_malformed_quantization_config_names_the_field():
    bad = _cfg()
    bad["quantization_config"]["weight_block_size"] = [128, 128]
    with pytest.raises(ValueError, match="quantization_config.weight_block_size=\\[128, 128\\]"):
        DeepseekV41Config.from_hf(bad)
    bad["quantization_config"] = {**_generator().QUANTIZATION, "expert_dtype": "fp8"}
    with pytest.raises(ValueError, match="quantization_config.expert_dtype='fp8'"):
        DeepseekV41Config.from_hf(bad)


# V4.1-Flash's text_config as DeepInfer reads it (spec §7; its 3 DSpark entries appended to compress_ratios,
# as DeepInfer asserts). Engram tokenizer compression is left out: openinfer refuses it for now.
V41_FLASH = dict(
    vocab_size=129280, hidden_size=5120, num_hidden_layers=40, num_attention_heads=64, head_dim=512,
    qk_rope_head_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024, n_routed_experts=384,
    num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2304, scoring_func="sqrtsoftplus",
    topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0, rms_norm_eps=1e-20,
    sliding_window=128, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 3, kv_source_layer_ids=[2, 8, 14, 20],
    index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36], index_n_heads=32, index_head_dim=128, index_topk=512,
    candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=[1, 14], engram_max_ngram_size=4, engram_n_heads=8,
    engram_head_dim=256, engram_vocab_size=16_000_000, engram_pad_token_id=2, num_nextn_predict_layers=3,
    dspark_block_size=5, dspark_target_layer_ids=[37, 38, 39], dspark_markov_rank=256, dspark_n_routed_experts=128,
    dspark_num_experts_per_tok=3, rope_theta=10000, compress_rope_theta=160000, max_position_embeddings=1048576,
    hidden_act="silu", attention_bias=False, num_key_value_heads=1,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                  "beta_slow": 1})


def test_v41_flash_kv_bytes_per_token_against_v4_flash():
    """What the engine logs at start-up (bf16, block 16), from the released configs on the meta device: V4.1
    holds 3,200 B/token for a sequence's life (C2 sources 2, 8, 14: (512 + 128) / 2 elements per token each;
    C1 source 20: 512 + 128) against V4-Flash's 6,880 - cross-layer sharing stores 4 layers' entries, not 38."""
    from tests.test_deepseek_v4 import V4_FLASH, _kv_report

    cfg = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": V41_FLASH,
           "quantization_config": dict(_generator().QUANTIZATION)}
    v41 = _kv_report(cfg)
    assert v41 == ("3200 bytes/token steady state + window group 47112 bytes/token over a 127-token lookback = "
                   "7537920 bytes per running sequence"), v41  # 40 x 512 + 3 x 1024 elements + 8 B of ids; 10 blocks
    assert _kv_report(V4_FLASH).startswith("6880 bytes/token")
