"""Speculative decoding end to end (n-gram and draft-model proposers): greedy output identical to plain decoding
and to HF through every scheduling path; stops, penalties and logprobs unchanged; sampling keeps its
distribution; a draft identical to the target accepts everything, a random one what chance gives; counters reach
the engine stats and /metrics; a method the model cannot serve fails at start-up."""
from __future__ import annotations

import random

import httpx
import pytest

from helpers import hf_greedy, kv_manager, make_dense_checkpoint
from openinfer import LLM, SamplingParams
from stats_utils import homogeneity

NEW_TOKENS = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def prompts_for(seed: int) -> list[list[int]]:
    """Mixed lengths; most prompts repeat a phrase so prompt lookup has something to propose from the start."""
    rng = random.Random(seed)
    out = []
    for n in (3, 17, 40, 5, 64, 9, 33, 70):
        phrase = [rng.randrange(6, 256) for _ in range(rng.randrange(3, 8))]
        body = (phrase * (n // len(phrase) + 1))[:n // 2] + [rng.randrange(6, 256) for _ in range(n - n // 2)]
        out.append(body)
    out[4] = out[1][:16] + out[4][16:]  # a shared 16-token prefix (one full block) for prefix caching
    return out


def draft_model(path) -> dict:
    return {"method": "draft_model", "num_speculative_tokens": 3, "model": str(path)}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request, tmp_path_factory):
    path = make_dense_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    prompts = prompts_for(7)
    return path, prompts, hf_greedy(path, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A one-layer Llama with other weights and the same vocabulary: a draft that is rarely right."""
    return make_dense_checkpoint(tmp_path_factory.mktemp("draft"), "llama", seed=5, num_hidden_layers=1)


def greedy(llm: LLM, prompts, **kw):
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, **kw)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def check(outs, ref, tol=1e-3):
    for out, (tokens, lps) in zip(outs, ref):
        got = out.outputs[0]
        assert got.token_ids == tokens
        assert max(abs(got.logprobs[i][t] - lp) for i, (t, lp) in enumerate(zip(tokens, lps))) < tol


def accepted(llm: LLM) -> int:
    spec = llm.engine.stats().spec_decode
    assert spec.num_drafts > 0 and spec.num_draft_tokens >= spec.num_drafts
    return spec.num_accepted_tokens


@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-small"])
@pytest.mark.parametrize("path_kind", ["mixed-batch", "chunked-prefill", "prefix-hits", "preemption"])
def test_greedy_matches_hf_through_every_scheduling_path(case, small_draft, path_kind, method):
    path, prompts, ref = case
    spec = {"ngram": NGRAM, "draft-self": draft_model(path), "draft-small": draft_model(small_draft)}[method]
    if method == "draft-small" and "qwen3" in str(path):
        spec = draft_model(make_dense_checkpoint(path.parent / "qwen3-draft", "qwen3", seed=5, num_hidden_layers=1))
    kw = dict(dtype="float32", speculative_config=spec, kv_cache_memory_gb=0.05)
    if path_kind == "chunked-prefill":
        kw["max_num_batched_tokens"] = 16  # prompts arrive in chunks while other requests verify drafts
    if path_kind == "preemption":
        del kw["kv_cache_memory_gb"]
        kw["num_kv_blocks"] = 12  # the batch needs ~25 blocks: requests are preempted mid-speculation
    llm = LLM(str(path), **kw)
    check(greedy(llm, prompts), ref)
    if path_kind == "prefix-hits":
        again = greedy(llm, prompts)
        check(again, ref)
        assert llm.engine.stats().prefix_cache_hits > 0
        assert all(o.num_cached_tokens > 0 for o, p in zip(again, prompts) if len(p) > 16)
    stats = llm.engine.stats()
    if path_kind == "preemption":
        assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_blocks  # every block back, drafts included
    assert kv_manager(llm).all_free()  # the draft model's groups too
    if method != "draft-small":
        assert accepted(llm) > 0


def test_a_draft_identical_to_the_target_accepts_everything_a_random_one_what_chance_gives(llama, small_draft):
    path, prompts = llama
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    rates = {}
    for name, draft in (("self", path), ("random", small_draft)):
        llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05, speculative_config=draft_model(draft))
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        s = llm.engine.stats().spec_decode
        rates[name] = s.num_accepted_tokens / s.num_draft_tokens
        if name == "self":
            assert s.accepted_per_pos[0] == s.num_drafts and s.mean_accepted_length > 3.0  # k = 3, all taken
    assert rates["self"] == 1.0
    # Chance: a draft that knows nothing matches the target's argmax about 1 time in 256 (the vocabulary).
    assert rates["random"] < 0.03, rates


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The request-level checks run once, on a Llama checkpoint."""
    return make_dense_checkpoint(tmp_path_factory.mktemp("llama-requests"), "llama"), prompts_for(7)


def test_stops_penalties_and_logprobs_identical_with_and_without_drafts(llama):
    path, prompts = llama
    plain = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05)
    spec = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05, speculative_config=NGRAM)
    base = greedy(plain, prompts[:1])[0].outputs[0].token_ids
    stop_tok = base[10]  # a token the output reaches mid-speculation
    cases = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # max_tokens cuts a verified run
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_tok], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=20, logprobs=3),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2),
    ]
    for sp in cases:
        a = plain.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        b = spec.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        for x, y in zip(a, b):
            gx, gy = x.outputs[0], y.outputs[0]
            assert (gx.token_ids, gx.text, gx.finish_reason, gx.stop_reason) == \
                (gy.token_ids, gy.text, gy.finish_reason, gy.stop_reason), sp
            if sp.logprobs is not None:
                assert [sorted(d) for d in gx.logprobs] == [sorted(d) for d in gy.logprobs]
                assert all(abs(d1[t] - d2[t]) < 1e-4 for d1, d2 in zip(gx.logprobs, gy.logprobs) for t in d1)
            if sp.prompt_logprobs is not None:
                assert [d and sorted(d) for d in x.prompt_logprobs] == [d and sorted(d) for d in y.prompt_logprobs]
    # Stop strings: the text of a few output tokens, found inside a verified run of drafts.
    text = plain.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(temperature=0, max_tokens=30,
                          ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    stop = text[12:14]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    a = plain.generate([{"prompt_token_ids": prompts[1]}], sp, use_tqdm=False)[0].outputs[0]
    b = spec.generate([{"prompt_token_ids": prompts[1]}], sp, use_tqdm=False)[0].outputs[0]
    assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason, stop)
    assert accepted(spec) > 0
    assert kv_manager(spec).all_free() and kv_manager(plain).all_free()


@pytest.mark.slow  # statistical: many samples
def test_sampling_keeps_its_distribution(llama):
    """Seeded requests sampled with and without drafts: their four tokens follow one distribution (a chi-square
    homogeneity test over the top-3 sequences), and the same test sees a sampler that is off (top-k 2 instead of
    3)."""
    path, prompts = llama
    # The prompt ends with the model's own greedy continuation, so prompt lookup drafts what the model tends to say.
    plain = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05)
    prompt = prompts[2] + greedy(plain, prompts[2:3])[0].outputs[0].token_ids
    n = 1000

    def draws(top_k: int, spec: dict | None, seed0: int) -> list[tuple[int, ...]]:
        kw = {"speculative_config": spec} if spec else {}
        llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05, **kw)
        sps = [SamplingParams(temperature=1.0, top_k=top_k, max_tokens=4, ignore_eos=True, seed=seed0 + i)
               for i in range(n)]
        outs = llm.generate([{"prompt_token_ids": prompt}] * n, sps, use_tqdm=False)
        if spec:
            assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
        return [tuple(o.outputs[0].token_ids) for o in outs]

    # Independent samples (other seeds), as the test assumes.
    off = draws(3, None, 1000)
    assert homogeneity(off, draws(3, NGRAM, 1000 + n)) > 1e-3
    assert homogeneity(off, draws(3, draft_model(path), 1000 + 2 * n)) > 1e-3
    assert homogeneity(off, draws(2, None, 1000 + 3 * n)) < 1e-4


def test_counters_reach_stats_and_metrics(llama):
    from server_utils import InProcessServer

    path, prompts = llama
    with InProcessServer(path, dtype="float32", kv_cache_memory_gb=0.05,
                         speculative_config=NGRAM) as server:
        body = {"model": "tiny", "prompt": prompts[5], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        m = server.metrics()
    drafts, tokens = m["openinfer:spec_decode_num_drafts_total"], m["openinfer:spec_decode_num_draft_tokens_total"]
    acc = m["openinfer:spec_decode_num_accepted_tokens_total"]
    per_pos = [m.get(f'openinfer:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}', 0)
               for i in range(3)]
    assert 0 < drafts <= tokens <= 3 * drafts and 0 <= acc <= tokens
    assert sum(per_pos) == acc and per_pos == sorted(per_pos, reverse=True)  # position i needs i - 1 accepted
    assert m["openinfer:spec_decode_mean_accepted_length"] == pytest.approx(1 + acc / drafts)


def test_methods_the_model_cannot_serve_fail_at_start_up(llama, tmp_path):
    path, _ = llama
    with pytest.raises(ValueError, match=r"method='mtp': LlamaForCausalLM has no MTP layers"):
        LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    other_vocab = make_dense_checkpoint(tmp_path / "v512", "llama", vocab_size=512, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"speculative_config.model has vocab_size=512, the target 256"):
        LLM(str(path), speculative_config=draft_model(other_vocab))
    short = make_dense_checkpoint(tmp_path / "short", "llama", max_position_embeddings=64, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"speculative_config.model: max_model_len=512 exceeds"):
        LLM(str(path), kv_cache_memory_gb=0.05, speculative_config=draft_model(short))
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(path), speculative_config=draft_model(tmp_path))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown keys"):
        LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 2, "k": 3})
