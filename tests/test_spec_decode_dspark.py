"""DeepSeek-V4.1 DSpark speculative decoding (``method: "mtp"`` on a V4.1 checkpoint, proposers/dspark.py):
greedy output identical with drafting on and off through mixed batches, 8-token chunks, prefix hits and forced
preemption; the engine's drafts equal the drafter run over a whole-sequence recompute of the target features (the
paged context keys are right on every path); a drafter that provably agrees with the target accepts every draft;
start-up errors name the field."""
from __future__ import annotations

import pytest
import torch

from openinfer import LLM, SamplingParams
from openinfer.models.deepseek_v41.reference import reference_logits
from tests.helpers import engine_model, kv_manager, make_dense_checkpoint
from tests.test_deepseek_v41 import _broken_copy, _generator, _prompts

NEW_TOKENS = 12
BASE = dict(dtype="float32", max_model_len=128)


def dspark(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def greedy(llm, prompts):
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    path = _generator().make_checkpoint(tmp_path_factory.mktemp("v41-dspark") / "tiny", "tiny", seed=0)
    prompts = _prompts(1, [3, 17, 30, 41, 52])
    prompts[4][:24] = prompts[3][:24]  # a shared prefix: hits within one run too
    return path, prompts, greedy(LLM(str(path), **BASE, num_kv_blocks=64), prompts)


def _engine(path, k: int, path_kind: str) -> LLM:
    kw = dict(BASE, speculative_config=dspark(k), num_kv_blocks=64)
    if path_kind == "chunked-prefill":
        kw.update(block_size=8, max_num_batched_tokens=8, num_kv_blocks=128)
    if path_kind == "preemption":
        kw.update(num_kv_blocks=9, max_num_batched_tokens=64)
    return LLM(str(path), **kw)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("path_kind", ["mixed-batch", "chunked-prefill", "prefix-hits", "preemption"])
def test_greedy_identical_with_dspark(v41, k, path_kind):
    path, prompts, ref = v41
    llm = _engine(path, k, path_kind)
    for _ in range(2 if path_kind == "prefix-hits" else 1):
        for out, want in zip(greedy(llm, prompts), ref):
            assert out.outputs[0].token_ids == want.outputs[0].token_ids
            assert max(abs(a[t] - b[t]) for a, b, t in zip(out.outputs[0].logprobs, want.outputs[0].logprobs,
                                                           want.outputs[0].token_ids)) < 1e-4
    stats = llm.engine.stats()
    assert stats.spec_decode.num_drafts > 0 and len(stats.spec_decode.accepted_per_pos) == k
    # the confidence head's predicted acceptance is reported per draft position (k positions, each in (0, 1))
    conf = stats.spec_decode.mean_confidence_per_pos
    assert len(conf) == k and all(0 < c < 1 for c in conf)
    assert stats.spec_decode.confidence_count_per_pos[0] == stats.spec_decode.num_drafts
    if path_kind == "preemption":
        assert stats.num_preemptions > 0
    if path_kind == "prefix-hits":
        assert stats.prefix_cache_hits > 0
    assert kv_manager(llm).all_free()
    assert "dspark.window" in kv_manager(llm).num_blocks


def test_prefix_hit_after_dspark_window_blocks_were_released(v41):
    """A long generation releases the dspark.window blocks behind its lookback (they keep their hashes); a request
    sharing its prompt + output hits them and still decodes exactly what drafting off decodes."""
    path, prompts, _ = v41
    kw = dict(BASE, block_size=8, max_num_batched_tokens=16, num_kv_blocks=64)
    llm = LLM(str(path), **kw, speculative_config=dspark(3))
    kv = kv_manager(llm)
    group = kv.groups[[g.name for g in kv.groups].index("dspark.window")]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.engine.add_request("long", {"prompt_token_ids": prompts[2]}, sp)
    released, out = 0, None
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            out = o
        if "long" in group.tables:
            released = max(released, group.tables["long"].count(None))
    assert released >= 4
    later = prompts[2] + out.outputs[0].token_ids[:30] + [7, 8, 9]
    got = greedy(llm, [later])[0]
    assert got.num_cached_tokens >= 56
    want = greedy(LLM(str(path), **kw), [later])[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert kv.all_free()


def test_a_prompt_chunk_short_of_a_block_is_not_cached_through_the_lookahead_slots(v41):
    """A prompt chunk ending 2 tokens before a block boundary, with k = 2 lookahead slots after it, once made that
    block "full" in the prefix cache although its last 2 rows (every group's: target KV, Engram ids, DSpark keys)
    were never written; a request preempted or aborted there left them so, and the next request with the prompt
    hit them and decoded other greedy tokens (seen with small pools, docs/composition.md)."""
    path, prompts, ref = v41
    llm = LLM(str(path), **BASE, block_size=8, max_num_batched_tokens=6, num_kv_blocks=32,
              speculative_config=dspark(2))
    llm.engine.add_request("cut", {"prompt_token_ids": prompts[2]}, SamplingParams(temperature=0, max_tokens=4))
    llm.engine.step()  # rows 0..5 of block 0 written
    llm.engine.abort_request("cut")
    got = greedy(llm, [prompts[2]])[0]
    assert got.num_cached_tokens == 0
    want = ref[2].outputs[0]
    assert got.outputs[0].token_ids == want.token_ids
    assert max(abs(a[t] - b[t]) for a, b, t in zip(got.outputs[0].logprobs, want.logprobs, want.token_ids)) < 1e-4

def _recorded_proposals(llm):
    """Wrap the proposer: every request's known tokens when it drafted, and its drafts."""
    proposer = llm.engine.core.executor.driver_worker.model_runner.proposer
    seen: list[tuple[list[int], list[int], list[float]]] = []
    inner = proposer.propose

    def propose(step):
        out = inner(step)
        for r in step.sampled:
            if r.state.req_id in out:
                seen.append((list(r.state.token_ids), out[r.state.req_id],
                             proposer.last_confidence[r.state.req_id]))
        return out

    proposer.propose = propose
    return seen


@pytest.mark.slow  # a whole-sequence recompute per step
@pytest.mark.parametrize("path_kind", ["chunked-prefill", "preemption"])
def test_engine_drafts_equal_a_whole_sequence_recompute(v41, path_kind):
    """For each proposal: the drafter over the target features recomputed from scratch for the request's tokens
    (window a - W + 1 .. a, a = L - 2) drafts what the engine drafted from its paged keys."""
    path, prompts, _ = v41
    k = 3
    llm = _engine(path, k, path_kind)
    seen = _recorded_proposals(llm)
    greedy(llm, prompts)
    greedy(llm, prompts)  # prefix hits
    model = engine_model(llm)
    w = model.config.sliding_window
    assert len(seen) > 20
    for tokens, drafts, conf in seen[::4]:
        feats: list[torch.Tensor] = []
        reference_logits(model, tokens[:-1], feats)
        features = torch.cat(feats, dim=-1)  # [L - 1, targets*D]
        a = len(tokens) - 2
        ctx_pos = torch.arange(a - w + 1, a + 1)
        window = features[ctx_pos.clamp(min=0)]
        want, want_conf = model.propose(window[None], ctx_pos.masked_fill(ctx_pos < 0, -1)[None],
                                        torch.tensor([tokens[-1]]), block_size=k)
        assert drafts == want[0].tolist()
        assert all(0 < c < 1 for c in conf)
        torch.testing.assert_close(torch.tensor(conf), want_conf[0], atol=1e-4, rtol=1e-4)


def test_a_drafter_that_agrees_with_the_target_accepts_everything(v41):
    """Zero the target's final norm and the drafter's (and its Markov table): both then score every token 0, so
    the greedy target emits token 0 and every draft is token 0 - acceptance is provably 100 % at every position."""
    path, prompts, _ = v41
    outs = {}
    for spec in (None, dspark(4)):
        llm = LLM(str(path), **BASE, num_kv_blocks=64, speculative_config=spec)
        model = engine_model(llm)
        model.model.norm.weight.data.zero_()
        model.mtp[-1].norm.weight.data.zero_()
        model.mtp[-1].markov_head.embed.weight.data.zero_()
        outs[spec is None] = [o.outputs[0].token_ids for o in greedy(llm, prompts)]
    assert outs[True] == outs[False] == [[0] * NEW_TOKENS] * len(prompts)
    s = llm.engine.stats().spec_decode
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens
    assert s.accepted_per_pos[0] == s.num_drafts and min(s.accepted_per_pos) > 0
    assert kv_manager(llm).all_free()


def test_dummy_block_forward_for_lockstep_replicas(v41):
    """Under DP + EP a replica with nothing to draft runs DSpark's block forward once as a dummy (the collective MoE
    of every draft block, under a dummy forward context: no expert load counted), leaving the key store as it was;
    ``forwards`` counts the real block forward of the last step (test_spec_decode_parallel runs it on two ranks)."""
    from openinfer.forward_context import peek_forward_context
    from openinfer.layers import dispatch

    path, prompts, _ = v41
    llm = LLM(str(path), **BASE, num_kv_blocks=16, speculative_config=dspark(2))
    runner = llm.engine.core.executor.driver_worker.model_runner
    prop = runner.proposer
    assert prop.lockstep_forwards == 1
    greedy(llm, prompts[:1])
    assert prop.forwards == 1
    seen = []
    hooks = [blk.mlp.register_forward_hook(lambda m, a, o: seen.append(peek_forward_context().is_dummy))
             for blk in engine_model(llm).mtp]
    keys = prop.module.keys.clone()
    with torch.inference_mode(), dispatch.use(runner.kernels):
        prop.dummy_forward(None, {}, None)
    for h in hooks:
        h.remove()
    assert seen == [True] * len(engine_model(llm).mtp)
    assert torch.equal(prop.module.keys, keys)


def test_start_up_errors_name_the_field(v41, tmp_path):
    path, _, _ = v41
    with pytest.raises(ValueError, match=r"no DSpark draft blocks \(mtp\.\* tensors\)"):
        LLM(str(_broken_copy(path, tmp_path / "no-mtp", drop="mtp.")), **BASE, num_kv_blocks=16,
            speculative_config=dspark(2))
    with pytest.raises(ValueError, match=r"num_speculative_tokens=5 exceeds the checkpoint's dspark_block_size=4"):
        LLM(str(path), **BASE, num_kv_blocks=16, speculative_config=dspark(5))
    # DP + EP: the draft blocks' own experts (dspark_n_routed_experts=4) must split over the ranks as the target's
    from openinfer.engine_args import EngineArgs

    with pytest.raises(ValueError, match=r"DSpark draft blocks' dspark_n_routed_experts=4 \+ num_redundant_experts=0 "
                                         r"over .*data_parallel_size=8 = 8 ranks"):
        EngineArgs(model=str(path), device="meta", data_parallel_size=8, enable_expert_parallel=True,
                   speculative_config=dspark(2)).create_engine_config()
    dense = make_dense_checkpoint(tmp_path / "llama")
    with pytest.raises(ValueError, match=r"speculative_config.method='mtp'.*has no MTP layers"):
        LLM(str(dense), dtype="float32", speculative_config=dspark(2))


def test_confidence_stats_record_and_merge():
    from openinfer.engine.spec_stats import SpecDecodeStats

    a, b = SpecDecodeStats(), SpecDecodeStats()
    a.record(3, 1, [0.5, 0.25, 0.125])
    a.record(2, 2)  # a proposer without a predictor: counted in acceptance, not in confidence
    b.record(1, 0, [0.75, 0.5])  # only the verified drafts' confidences count
    m = a.merge(b)
    assert m.accepted_per_pos == [2, 1, 0] and m.num_drafts == 3
    assert m.confidence_count_per_pos == [2, 1, 1]
    assert m.mean_confidence_per_pos == [0.625, 0.25, 0.125]


# -- temperature > 0: sampled drafts with their distributions --------------------------------------------------

SAMPLED = dict(temperature=0.8, top_k=3)  # top-k 3 over 3 tokens: 27 outcomes, a few thousand samples suffice


def _exact_three_tokens(model, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """The target's own distribution of its first three sampled tokens after ``prompt`` (whole-sequence
    recomputes; temperature and top-k applied as the sampler applies them)."""
    from openinfer.worker.sampler import SamplingRow, sampling_probs

    def dist(logits: torch.Tensor) -> torch.Tensor:
        return sampling_probs(logits[None].float(), [SamplingRow(params, prompt, [])])[0].double()

    out: dict[tuple[int, ...], float] = {}
    first = dist(reference_logits(model, prompt)[-1])
    for t1 in first.nonzero().flatten().tolist():
        second = dist(reference_logits(model, prompt + [t1])[-1])
        for t2 in second.nonzero().flatten().tolist():
            third = dist(reference_logits(model, prompt + [t1, t2])[-1])
            for t3 in third.nonzero().flatten().tolist():
                out[(t1, t2, t3)] = float(first[t1] * second[t2] * third[t3])
    return out


def test_sampled_drafts_keep_the_target_distribution(v41):
    """temperature > 0: the drafts are drawn from the drafter's (Markov-corrected, temperature, top-k) distribution
    and verified against it, so the emitted tokens follow the target's own distribution (chi-square against the
    exact three-token distribution), drafts are both accepted and rejected on the way, and the same test rejects
    a distribution half-way from the target's to uniform (its power). The random tiny drafter's top-3 never meets
    the target's, so its corrected logits are made the target's own plus noise (a drafter that half agrees):
    everything after them - the draw, the hand-over, the rejection sampler - is the engine's."""
    from stats_utils import goodness_of_fit

    path, prompts, _ = v41
    prompt = prompts[0][:6]
    llm = LLM(str(path), **BASE, num_kv_blocks=1200, max_num_seqs=512, speculative_config=dspark(2))
    model = engine_model(llm)
    sp = SamplingParams(max_tokens=3, ignore_eos=True, **SAMPLED)
    first = reference_logits(model, prompt)[-1]
    noise = torch.randn(first.shape[0], generator=torch.Generator().manual_seed(0)) * 0.7
    target_after = {t: reference_logits(model, prompt + [t])[-1] for t in first.topk(3).indices.tolist()}
    corrected = model.mtp.corrected

    def half_agreeing(hidden, logits, prev, temperature=1.0):
        step, conf = corrected(hidden, logits, prev, temperature)
        for row, t in enumerate(prev.tolist()):
            if t in target_after:  # the first draft after the first sampled token
                step[row] = target_after[t] + noise
        return step, conf

    model.mtp.corrected = half_agreeing
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2000, sp, use_tqdm=False)
    samples = [tuple(o.outputs[0].token_ids) for o in outs]
    expected = _exact_three_tokens(model, prompt, sp)
    assert goodness_of_fit(samples, expected) > 1e-3
    uniform = 1 / len(expected)
    assert goodness_of_fit(samples, {s: 0.5 * p + 0.5 * uniform for s, p in expected.items()}) < 1e-6
    # Acceptance is speculative sampling's: a draft drawn from q is kept with probability sum_x min(p(x), q(x))
    # (handed as one-hot, as before, it would be sum_x q(x) p(x): still exact, but lower).
    from openinfer.worker.sampler import SamplingRow, sampling_probs

    def dist(logits):
        return sampling_probs(logits[None].float(), [SamplingRow(sp, prompt, [])])[0].double()

    p1 = dist(first)
    want = sum(float(p1[t]) * float(torch.minimum(dist(after), dist(after + noise)).sum())
               for t, after in target_after.items())
    s = llm.engine.stats().spec_decode
    assert s.num_draft_tokens == len(samples)  # one draft verified per request (max_tokens=3)
    sd = (want * (1 - want) / len(samples)) ** 0.5
    assert abs(s.num_accepted_tokens / s.num_draft_tokens - want) < 4 * sd, (s.num_accepted_tokens, want)
    assert kv_manager(llm).all_free()


def test_seeded_sampling_repeats_with_sampled_drafts(v41):
    """A seeded request draws its drafts from its own generators too: the same request twice, in different batch
    company, gives the same tokens."""
    path, prompts, _ = v41
    llm = LLM(str(path), **BASE, num_kv_blocks=64, speculative_config=dspark(3))
    sp = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=s) for s in (1, 2)]
    a = llm.generate([{"prompt_token_ids": prompts[1]}, {"prompt_token_ids": prompts[2]}], sp, use_tqdm=False)
    b = llm.generate([{"prompt_token_ids": prompts[2]}], sp[1:], use_tqdm=False)
    assert a[1].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert llm.engine.stats().spec_decode.num_draft_tokens > 0


# -- confidence-scheduled verification ---------------------------------------------------------------------------

def test_confidence_scheduling_keeps_greedy_and_verifies_what_the_head_picks(v41):
    """speculative_config.confidence_token_cost: greedy output unchanged, and each step's requests verify exactly
    the drafts engine/confidence_schedule.py picks from the confidence head's predictions for that step's
    proposals (fewer than all of them at this cost)."""
    from openinfer.engine.confidence_schedule import drafts_to_verify

    path, prompts, ref = v41
    cost = 0.3
    llm = LLM(str(path), **BASE, num_kv_blocks=64,
              speculative_config={**dspark(4), "confidence_token_cost": cost})
    (sched,) = llm.engine.core.schedulers
    picked: list[tuple[list[int], list[int]]] = []
    inner = sched.update_from_output

    def update(s, result):
        outputs = inner(s, result)
        reqs = [sched.requests[rid] for rid in result.spec_token_ids if rid in sched.requests
                and sched.requests[rid].status.name == "RUNNING" and result.spec_token_ids[rid]]
        want = drafts_to_verify([result.spec_confidence[r.request_id] for r in reqs], cost)
        picked.append(([len(r.spec_token_ids) for r in reqs], want))
        return outputs

    sched.update_from_output = update
    for out, want in zip(greedy(llm, prompts), ref):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert picked and all(got == want for got, want in picked)
    verified = sum(sum(got) for got, _ in picked)
    assert 0 < verified < 4 * sum(len(got) for got, _ in picked)
    assert len({n for got, _ in picked for n in got}) > 1  # the head's predictions make the counts differ
    assert kv_manager(llm).all_free()
