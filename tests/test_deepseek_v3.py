"""DeepSeek-V3 in openinfer against HF transformers on tiny random fp32 checkpoints, plus unit checks of the
MLA fast path, the router, the latent KV cache size, weight loading and config validation."""
from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from helpers import engine_model, hf_greedy, load_script, write_char_tokenizer

from openinfer import LLM, SamplingParams
from openinfer.config import AttentionBackend
from openinfer.forward_context import AttentionMetadata, set_forward_context
from openinfer.worker.loader import iterate_weights
from openinfer.layers.deepseek_moe import RouterConfig, route
from openinfer.layers.mla import MLAAttention
from openinfer.models.deepseek_v3 import DeepseekV3ForCausalLM
from openinfer.models.weights import WeightLoadError

VOCAB = 128
PROMPT_LENS = (5, 70, 17, 90, 3, 33, 66, 12)  # mixed, several longer than 64 (4+ blocks of 16)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)

# YaRN with mscale != mscale_all_dim exercises both the cos/sin attention factor and the softmax mscale^2.
V3_KW = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, first_k_dense_replace=1, q_lora_rank=32,
             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
             num_experts_per_tok=2, n_group=2, topk_group=1, max_position_embeddings=256, bos_token_id=0,
             eos_token_id=1,
             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                  original_max_position_embeddings=64, beta_fast=32, beta_slow=1, mscale=1.0,
                                  mscale_all_dim=0.8))


def make_hf_v3(path: Path, seed: int = 0, **overrides) -> Path:
    import transformers

    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**{**V3_KW, **overrides})
    model = transformers.DeepseekV3ForCausalLM(config).float()
    with torch.no_grad():  # larger-than-init weights spread the logits, so greedy ties are unlikely
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # non-zero so selection differs from the weights
                b.normal_(0, 0.05)
    model.save_pretrained(str(path))
    write_char_tokenizer(path, VOCAB)
    return path


def make_prompts(lens=PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, VOCAB, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = make_hf_v3(tmp_path_factory.mktemp("dsv3"))
    prompts = make_prompts()
    return path, prompts, hf_greedy(path, prompts, 32)


def load_generator():
    return load_script("make_deepseek_checkpoint")


def generate(llm: LLM, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_matches_hf(outs, ref, tol: float = 1e-3) -> None:
    for i, (out, (toks, lps)) in enumerate(zip(outs, ref)):
        got = out.outputs[0]
        assert got.token_ids == toks, f"prompt {i}: greedy tokens differ from HF"
        for j, tok in enumerate(toks):
            assert abs(got.logprobs[j][tok] - lps[j]) < tol, f"prompt {i} token {j}"


def test_matches_hf(v3):
    path, prompts, ref = v3
    assert len({t for toks, _ in ref for t in toks}) > 20  # the reference is not degenerate
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    assert_matches_hf(generate(llm, prompts), ref)


def test_chunked_prefill_and_prefix_cache_match_hf(v3):
    path, prompts, ref = v3
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=8, num_kv_blocks=64)
    assert_matches_hf(generate(llm, prompts), ref)
    again = generate(llm, prompts)  # same prompts: full blocks now come from the prefix cache
    assert_matches_hf(again, ref)
    assert all(o.num_cached_tokens > 0 for o, n in zip(again, PROMPT_LENS) if n > 16)


def test_preemption_matches_hf_on_reference_backend(v3):
    path, prompts, ref = v3
    # 122 tokens fit in 8 blocks; all 8 requests need ~40, so requests must be preempted and recomputed.
    llm = LLM(str(path), dtype="float32", num_kv_blocks=12, attention_backend="reference")
    assert_matches_hf(generate(llm, prompts), ref)
    assert llm.engine.stats().num_preemptions > 0


def test_variant_without_q_lora_interleave_or_groups(tmp_path):
    # The other config branches: q_proj, rotate-half RoPE, default RoPE, no group limit, no renorm, 2 shared.
    path = make_hf_v3(tmp_path, seed=3, q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                      norm_topk_prob=False, n_shared_experts=2, num_hidden_layers=2, rope_parameters=None)
    prompts = make_prompts((40, 7, 21), seed=4)
    ref = hf_greedy(path, prompts, 8)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32)
    assert_matches_hf(generate(llm, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                            logprobs=0)), ref)


def test_generator_checkpoint_loads_in_hf_and_openinfer(tmp_path):
    from transformers import AutoModelForCausalLM

    gen = load_generator()
    path = gen.make_v3(tmp_path / "gen", "tiny", seed=5, shard_gb=1e-4)  # many shards + an index
    assert (path / "model.safetensors.index.json").is_file()
    _, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert not any(info.values()), info
    prompts = make_prompts((20, 9), seed=6)
    ref = hf_greedy(path, prompts, 8)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=16)
    assert_matches_hf(generate(llm, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                            logprobs=0)), ref)


def test_mla_fast_path_equals_reference():
    torch.manual_seed(0)
    h, lr, dn, r, dv, bs = 4, 32, 16, 8, 16, 4
    attn = MLAAttention(h, lr, dn, r, dv, scale=0.2)
    cache = torch.randn(24, bs, lr + r)
    kv_b = 0.2 * torch.randn(h * (dn + dv), lr)
    # Two decodes (context 6 and 13), a prefill chunk after 9 cached tokens, a fresh 7-token prompt.
    seqs = [([3, 7], 6, 1), ([10, 2, 20, 5], 13, 1), ([1, 4, 8, 9], 16, 7), ([11, 12], 7, 7)]
    md = AttentionMetadata.build([n for _, _, n in seqs], [ctx for _, ctx, _ in seqs],
                                 {"full": [t for t, _, _ in seqs]}, {"full": bs}, bs, torch.device("cpu"))
    off = md.num_tokens
    q_nope, q_pe = torch.randn(off, h, dn), torch.randn(off, h, r)
    c_kv, k_pe = torch.randn(off, lr), torch.randn(off, r)
    outs = {}
    for backend in AttentionBackend:
        attn.backend, attn.kv_cache = backend, cache.clone()
        with set_forward_context(md):
            outs[backend] = attn(q_nope, q_pe, c_kv, k_pe, kv_b)
    torch.testing.assert_close(outs[AttentionBackend.SDPA], outs[AttentionBackend.REFERENCE], atol=1e-5, rtol=1e-5)


def reference_route(logits, cfg: RouterConfig, bias):
    """One token at a time with Python sorting; ties go to the lower index."""
    weights, ids = [], []
    per_group = cfg.n_routed_experts // cfg.n_group
    for row in logits.tolist():
        scores = [1 / (1 + torch.tensor(x).neg().exp().item()) for x in row]
        choice = [s + float(b) for s, b in zip(scores, bias)]
        group_score = [sum(sorted(choice[g * per_group:(g + 1) * per_group])[-2:])
                       for g in range(cfg.n_group)]
        groups = sorted(range(cfg.n_group), key=lambda g: (-group_score[g], g))[:cfg.topk_group]
        allowed = [e for e in range(cfg.n_routed_experts) if e // per_group in groups]
        top = sorted(allowed, key=lambda e: (-choice[e], e))[:cfg.num_experts_per_tok]
        w = [scores[e] for e in top]
        if cfg.norm_topk_prob:
            w = [x / (sum(w) + 1e-20) for x in w]
        weights.append([x * cfg.routed_scaling_factor for x in w])
        ids.append(top)
    return torch.tensor(weights), torch.tensor(ids)


def test_router_matches_reference_and_hf():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = RouterConfig(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
                       routed_scaling_factor=2.5)
    torch.manual_seed(0)
    x, w, bias = torch.randn(64, 32), torch.randn(16, 32), 0.1 * torch.randn(16)
    weights, ids = route(x @ w.t(), cfg, bias)
    ref_w, ref_ids = reference_route(x @ w.t(), cfg, bias)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)

    hf = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3,
                                               n_group=4, topk_group=2, routed_scaling_factor=2.5))
    with torch.no_grad():
        hf.weight.copy_(w)
        hf.e_score_correction_bias.copy_(bias)
    _, hf_w, hf_ids = hf(x)
    order = hf_ids.argsort(dim=-1)  # HF returns them unsorted; compare as sets with their weights
    ours = ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, order), ids.gather(1, ours))
    torch.testing.assert_close(hf_w.gather(1, order), weights.gather(1, ours))

    # Exact ties pick the lowest indices (group 0, then experts 0..k-1), whatever the batch size.
    tie_w, tie_ids = route(torch.zeros(5, 16), cfg)
    assert tie_ids.tolist() == [[0, 1, 2]] * 5


def test_kv_bytes_per_token_is_the_latent(v3):
    path = v3[0]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=10)
    model = engine_model(llm)
    assert model.kv_cache_spec(16, torch.float32)[0].bytes_per_block == 16 * 3 * (32 + 8) * 4
    assert llm.engine.kv_bytes_per_token == 3 * (32 + 8) * 4
    assert all(a.kv_cache.shape == (10, 16, 40) for a in model.attention_layers())
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        assert DeepseekV3ForCausalLM(hf_config(path)).kv_cache_spec(1, torch.bfloat16)[0].bytes_per_block == 3 * 40 * 2
    finally:
        torch.set_default_dtype(prev)


def hf_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _drop(field):
    def mutate(cfg):
        del cfg[field]
    return mutate


def _set(field, value):
    def mutate(cfg):
        cfg[field] = value
    return mutate


@pytest.mark.parametrize("mutate,field", [
    (_set("scoring_func", "relu"), "scoring_func"),
    (_set("topk_method", "greedy"), "topk_method"),
    (_set("n_group", 3), "n_group"),
    (_set("topk_group", 3), "topk_group"),
    (_set("num_experts_per_tok", 9), "num_experts_per_tok"),
    (_drop("kv_lora_rank"), "kv_lora_rank"),
    (_set("qk_rope_head_dim", 7), "qk_rope_head_dim"),
    (_set("hidden_act", "gelu"), "hidden_act"),
    (_set("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "rope"),
    (_set("quantization_config", {"quant_method": "gptq"}), "quant_method"),
])
def test_malformed_config_rejected(v3, mutate, field):
    cfg = copy.deepcopy(hf_config(v3[0]))
    mutate(cfg)
    with pytest.raises(ValueError, match=field):
        DeepseekV3ForCausalLM(cfg)


def test_load_weights_skips_mtp_and_names_bad_tensors(v3, caplog):
    path = v3[0]
    tensors = list(iterate_weights(path))
    mtp = [("model.layers.3.eh_proj.weight", torch.zeros(64, 128)),
           ("model.layers.3.self_attn.q_a_proj.weight", torch.zeros(32, 64))]
    with caplog.at_level(logging.INFO, logger="openinfer.models.deepseek_v3"):
        DeepseekV3ForCausalLM(hf_config(path)).load_weights(tensors + mtp)
    assert sum("MTP" in r.getMessage() for r in caplog.records) == 1

    missing = [(n, t) for n, t in tensors if n != "model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"experts\.5\.up_proj"):
        DeepseekV3ForCausalLM(hf_config(path)).load_weights(missing)
    for bad in ("model.layers.0.mlp.experts.0.gate_proj.weight",  # layer 0 is dense
                "model.layers.1.mlp.experts.8.gate_proj.weight",  # only 8 experts
                "model.layers.1.self_attn.q_proj.weight"):  # q_lora_rank is set
        with pytest.raises(WeightLoadError, match=bad.replace(".", r"\.")):
            DeepseekV3ForCausalLM(hf_config(path)).load_weights(tensors + [(bad, torch.zeros(32, 64))])
