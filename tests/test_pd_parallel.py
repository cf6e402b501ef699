"""The NIXL connector on many ranks (mp executor, gloo on 127.0.0.1, real NIXL over UCX on host memory): every
rank runs its own agent over its shard and its own side channel, each data-parallel replica is an engine of its
own to the other side, and a replica's ranks' reports are combined (a prompt has moved once every rank read its
shard). Greedy tokens identical to one process, pull and push, with every block back in both sides' pools; a
producer rank killed while the decoder reads ends in the decoder computing the prompt itself; decoders of another
tensor_parallel_size take the slices of the KV heads they own (split caches) or a whole copy (latent caches)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import make_dense_checkpoint, random_prompts
from test_kv_nixl_engines import stepping

from openinfer import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

# Two engines of two worker processes each, plus a one-process reference, per module: > 20 s on 2 cores.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

KW = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=16)


def _pd(ck, layout: dict, spec: dict | None = None, send_types=("GET", "PUT"), **kt):
    def pd(role, **extra):
        cfg = {"kv_connector": "NixlConnector", "kv_role": role, "load_timeout_s": 3.0, **kt, **extra}
        return LLM(str(ck), kv_transfer_config=json.dumps(cfg), speculative_config=spec, **KW, **layout)

    engines = {"prod": pd("kv_producer"), "ref": LLM(str(ck), speculative_config=spec, **KW)}
    for t in send_types:
        engines[t] = pd("kv_consumer", kv_connector_extra_config={"send_type": t})
    return engines


def _greedy(llm, prompts, n, params=None):
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, kv_transfer_params=p)
           for p in (params or [None] * len(prompts))]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)


def _all_free(llm) -> bool:
    return all(kv.all_free() for kv in llm.engine.core.kvs)


def _drain(prod) -> None:
    for _ in range(200):
        if not prod.engine.has_unfinished_requests():
            break
        prod.engine.step()


def _check_pd(engines, send_type, prompts, n=8):
    """All prompts at once through the producer (spread over its replicas) and then the decoder: tokens as one
    process; every prompt but its last token moved; both sides' pools whole again."""
    prod, cons, ref = engines["prod"], engines[send_type], engines["ref"]
    want = [o.outputs[0].token_ids for o in _greedy(ref, prompts, n)]
    held = _greedy(prod, prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    before = cons.engine.stats().kv_transfer
    with stepping(prod):
        got = _greedy(cons, prompts, n, [h.kv_transfer_params for h in held])
    assert [o.outputs[0].token_ids for o in got] == want
    assert [o.num_cached_tokens for o in got] == [len(p) - 1 for p in prompts]
    after = cons.engine.stats().kv_transfer
    assert after.loads_ok - before.loads_ok == len(prompts) and after.fallbacks == before.fallbacks
    _drain(prod)
    assert _all_free(prod) and _all_free(cons)
    return held


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory):
    pytest.importorskip("nixl")
    # A short abort timeout: held prompts whose decoder died go back within the test (vLLM's default is 480 s).
    engines = _pd(make_dense_checkpoint(tmp_path_factory.mktemp("pd-tp") / "llama"), {"tensor_parallel_size": 2},
                  abort_request_timeout_s=4.0)
    yield engines
    for llm in engines.values():
        llm.engine.shutdown()


@pytest.mark.parametrize("send_type", ["GET", "PUT"])
def test_tp2_to_tp2_llama(llama_tp2, send_type):
    """Each rank holds half the KV heads: decoder rank i reads (or is written) producer rank i's shard over its
    own agent; kv_transfer_params name every producer rank's side channel."""
    held = _check_pd(llama_tp2, send_type, random_prompts(0, [40, 17, 5]))
    params = held[0].kv_transfer_params
    assert params["tp_size"] == 2 and len(params["remote_ports"]) == 2
    assert params["remote_port"] == params["remote_ports"][0]


@pytest.mark.parametrize("send_type", ["GET", "PUT"])
def test_tp2_to_tp1_and_back_llama(llama_tp2, send_type):
    """Heterogeneous tensor parallelism on split KV heads (Llama's GQA cache, each rank half the KV heads), as vLLM's
    NIXL connector does it: a TP 1 decoder gathers both producer ranks' halves of every token row (one read - or
    one write, push - per producer rank); then that instance prefills for the TP 2 decoder, whose ranks each take
    their half of its rows. Tokens as one process; both sides' pools whole."""
    extra = {"kv_connector_extra_config": {"send_type": "PUT"}} if send_type == "PUT" else {}
    one = LLM(llama_tp2["prod"].engine.config.model.path, kv_transfer_config=json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": "kv_both", "load_timeout_s": 3.0, **extra}), **KW)
    try:
        seed = 20 if send_type == "GET" else 22  # prompts neither side has cached
        _check_pd({"prod": llama_tp2["prod"], send_type: one, "ref": llama_tp2["ref"]}, send_type,
                  random_prompts(seed, [40, 17, 5]))
        held = _check_pd({"prod": one, send_type: llama_tp2[send_type], "ref": llama_tp2["ref"]}, send_type,
                         random_prompts(seed + 1, [40, 17, 5]))
        assert held[0].kv_transfer_params["tp_size"] == 1
    finally:
        one.engine.shutdown()


@pytest.fixture(scope="module")
def v3_dp2_ep_mtp(tmp_path_factory):
    """One producer and one reference for both decoders (pull and push): two fewer deployments to start."""
    pytest.importorskip("nixl")
    from make_deepseek_checkpoint import make_v3

    ck = make_v3(tmp_path_factory.mktemp("pd-dp"), "tiny", overrides={"num_nextn_predict_layers": 1})
    engines = _pd(ck, {"data_parallel_size": 2, "enable_expert_parallel": True},
                  {"method": "mtp", "num_speculative_tokens": 2})
    yield engines
    for llm in engines.values():
        llm.engine.shutdown()


@pytest.mark.parametrize("send_type", ["GET", "PUT"])
def test_dp2_ep_to_dp2_ep_deepseek_v3_with_mtp(v3_dp2_ep_mtp, send_type):
    """Prefill DP = 2 + EP and decode DP = 2 + EP with MTP k = 2 on both (the MTP layer's KV moves with the
    target's): the prompts spread over both producer replicas (each its own engine id and pool) and both decoder
    replicas; tokens as one process with MTP."""
    engines = v3_dp2_ep_mtp
    seed = 2 if send_type == "GET" else 3  # prompts the shared producer has not computed yet
    held = _check_pd(engines, send_type, random_prompts(seed, [40, 17, 33, 5]))
    ids = {h.kv_transfer_params["remote_engine_id"] for h in held}
    assert len(ids) == 2 and all(i.endswith(("_dp0", "_dp1")) for i in ids)  # both producer replicas served
    s = engines[send_type].engine.stats()
    assert s.spec_decode.num_draft_tokens > 0
    assert all(r[0] == 0 for r in s.rank_loads)


def _kv_consumer_tp2(path: str, **kt):
    return LLM(path, kv_transfer_config=json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                                                    "load_timeout_s": 3.0, **kt}), tensor_parallel_size=2, **KW)


def test_a_decoder_rank_killed_mid_stream(llama_tp2):
    """A decoder rank dies while its request streams: the request ends with an error naming the rank, the dead
    decoder's blocks are all back (nothing runs there again), and the producer, which keeps serving, frees the
    prompt that decoder read (its readers' notifications) and the one it never came for (abort timeout)."""
    import time

    from openinfer.engine.core import EngineDeadError

    prod = llama_tp2["prod"]
    a, b = random_prompts(7, [36, 21])
    held = [h.kv_transfer_params for h in _greedy(prod, [a, b], 1, [{"do_remote_decode": True}] * 2)]
    cons = _kv_consumer_tp2(prod.engine.config.model.path)
    try:
        cons.engine.add_request("a", {"prompt_token_ids": a}, SamplingParams(
            temperature=0, max_tokens=50, ignore_eos=True, kv_transfer_params=held[0]))
        streamed, err = 0, None
        with stepping(prod):
            for _ in range(2000):  # bounded: the read, then a token a step
                try:
                    outs = cons.engine.step()
                except EngineDeadError as e:
                    err = str(e)
                    break
                streamed += sum(len(o.outputs[0].token_ids) for o in outs if o.outputs)
                if streamed >= 2 and cons.engine.core.executor.procs[1].poll() is None:
                    cons.engine.core.executor.procs[1].kill()
        assert err is not None and "worker rank 1" in err, err
        assert _all_free(cons)
        deadline = time.monotonic() + 30
        while not _all_free(prod) and time.monotonic() < deadline:  # b's hold expires after 4 s
            prod.engine.step()
            time.sleep(0.05)
        assert _all_free(prod)
        s = prod.engine.stats().kv_transfer
        assert s.sends_expired >= 1
        # The producer keeps serving.
        want = _greedy(llama_tp2["ref"], [b], 4)[0].outputs[0].token_ids
        assert _greedy(prod, [b], 4)[0].outputs[0].token_ids == want
    finally:
        cons.engine.shutdown()


def test_a_producer_rank_killed_before_the_read(llama_tp2):
    """A producer rank dies while it holds a prompt: the decoder rank paired with it cannot reach it, so the whole
    replica's read fails (never half a prompt) and the decoder computes the prompt itself - same tokens, every block
    back; the dead producer fails its next step naming the rank."""
    from openinfer.engine.core import EngineDeadError

    path = llama_tp2["prod"].engine.config.model.path
    prod = LLM(path, kv_transfer_config=json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}),
               tensor_parallel_size=2, **KW)
    try:
        (prompt,) = random_prompts(8, [30])
        held = _greedy(prod, [prompt], 1, [{"do_remote_decode": True}])[0].kv_transfer_params
        prod.engine.core.executor.procs[1].kill()
        prod.engine.core.executor.procs[1].wait(10)
        cons = llama_tp2["GET"]
        before = cons.engine.stats().kv_transfer
        got = _greedy(cons, [prompt], 6, [held])[0]
        assert got.outputs[0].token_ids == _greedy(llama_tp2["ref"], [prompt], 6)[0].outputs[0].token_ids
        assert got.num_cached_tokens == 0
        after = cons.engine.stats().kv_transfer
        assert after.fallbacks == before.fallbacks + 1 and after.load_failures == before.load_failures + 1
        assert _all_free(cons)
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            _greedy(prod, [prompt], 2)
    finally:
        prod.engine.shutdown()


def test_tp2_to_dp2_ep_and_back_deepseek_v3(tmp_path_factory):
    """Heterogeneous layouts where every rank holds the whole KV (DeepSeek's latent cache): prefill TP 2 -> decode
    DP 2 + EP by pull (each replica one rank reads producer rank 0's copy and tells rank 1 it is done), and the
    reverse by push (both decoder ranks register with the producer replica's one rank, which writes its copy into
    each and frees once both were written); MTP k = 2 throughout."""
    pytest.importorskip("nixl")
    from make_deepseek_checkpoint import make_v3

    ck = make_v3(tmp_path_factory.mktemp("pd-het"), "tiny", overrides={"num_nextn_predict_layers": 1})
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    kt = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "load_timeout_s": 3.0}
    push = json.dumps({**kt, "kv_connector_extra_config": {"send_type": "PUT"}})  # send_type: the decoding side's
    tp2 = LLM(str(ck), kv_transfer_config=push, speculative_config=spec, tensor_parallel_size=2, **KW)
    kt = json.dumps(kt)
    dep = LLM(str(ck), kv_transfer_config=kt, speculative_config=spec, data_parallel_size=2,
              enable_expert_parallel=True, **KW)
    ref = LLM(str(ck), speculative_config=spec, **KW)
    try:
        for prod, cons, send_type in ((tp2, dep, "GET"), (dep, tp2, "PUT")):
            held = _check_pd({"prod": prod, send_type: cons, "ref": ref}, send_type, random_prompts(3, [40, 17, 33]))
            assert {h.kv_transfer_params["tp_size"] for h in held} == {prod.engine.config.parallel.tensor_parallel_size}
    finally:
        for llm in (tp2, dep, ref):
            llm.engine.shutdown()


def test_dp2_ep_to_dp2_ep_deepseek_v4_with_mtp_chunked_and_prefix_hits(tmp_path_factory):
    """DeepSeek-V4's three KV groups (full, sliding window with released blocks, coarse compressed entries; 8-token
    blocks) plus its MTP block's, from prefill DP 2 + EP to decode DP 2 + EP, MTP k = 2 on both: pull one way, push
    the other (each instance decodes with its own send_type). The producer prefills in 16-token chunks; the second
    round's prompts extend the first's, so both sides resume from prefix hits and only the rest moves. Tokens as one
    process with MTP; both sides' pools whole."""
    pytest.importorskip("nixl")
    from test_deepseek_v4 import _generator, write_release_with_mtp

    tmp = tmp_path_factory.mktemp("pd-v4")
    hf = _generator().make_checkpoint(tmp / "tiny", "tiny", seed=0)
    write_release_with_mtp(hf, tmp / "release")
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    kw = {**KW, "block_size": 8, "tokenizer": str(hf), "max_num_batched_tokens": 16}
    kt = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "load_timeout_s": 3.0}
    dep = dict(data_parallel_size=2, enable_expert_parallel=True, speculative_config=spec, **kw)
    pull = LLM(str(tmp / "release"), kv_transfer_config=json.dumps(kt), **dep)
    push = LLM(str(tmp / "release"), kv_transfer_config=json.dumps(
        {**kt, "kv_connector_extra_config": {"send_type": "PUT"}}), **dep)
    ref = LLM(str(tmp / "release"), speculative_config=spec, **kw)
    try:
        for prod, cons, send_type, seed in ((push, pull, "GET", 4), (pull, push, "PUT", 5)):
            _rounds_with_prefix_hits({"prod": prod, send_type: cons, "ref": ref}, cons, send_type, seed)
            assert cons.engine.stats().spec_decode.num_draft_tokens > 0
    finally:
        for llm in (pull, push, ref):
            llm.engine.shutdown()


def test_dp2_ep_to_dp2_ep_deepseek_v41_with_dspark_chunked_and_prefix_hits(tmp_path_factory):
    """DeepSeek-V4.1 (full and window groups, Engram ids in the window) with DSpark k = 2 on both sides - its context
    keys, the ``dspark.window`` group, move with the target's - from prefill DP 2 + EP to decode DP 2 + EP: pull one
    way, push the other, 16-token prefill chunks, a second round resuming from prefix hits on both sides. The
    decoder's replicas draft through the draft blocks' expert-parallel MoE in lockstep (a dummy block forward where
    a replica has nothing to draft). Tokens as one process with DSpark, and its drafts too (the confidence head's
    predictions summed per position; checked by hand: with the dspark.window stores swapped for zeroed ones in the
    transfer, the tokens and counts stay the same and the sums differ); both sides' pools whole."""
    pytest.importorskip("nixl")
    from helpers import load_script

    ck = load_script("make_deepseek_v41_checkpoint").make_checkpoint(tmp_path_factory.mktemp("pd-v41") / "v41",
                                                                      "tiny", seed=0, quantize=False)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    kw = {**KW, "block_size": 8, "max_num_batched_tokens": 16}
    kt = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "load_timeout_s": 3.0}
    dep = dict(data_parallel_size=2, enable_expert_parallel=True, speculative_config=spec, **kw)
    pull = LLM(str(ck), kv_transfer_config=json.dumps(kt), **dep)
    push = LLM(str(ck), kv_transfer_config=json.dumps({**kt, "kv_connector_extra_config": {"send_type": "PUT"}}),
               **dep)
    ref = LLM(str(ck), speculative_config=spec, **kw)
    try:
        assert [s.name for s in pull.engine.core.kv_specs] == ["full", "window", "dspark.window"]
        for prod, cons, send_type, seed in ((push, pull, "GET", 4), (pull, push, "PUT", 5)):
            before = _drafting(cons), _drafting(ref)
            _rounds_with_prefix_hits({"prod": prod, send_type: cons, "ref": ref}, cons, send_type, seed)
            # The same drafts as one process: counts, and the confidence head's predicted acceptance summed per
            # position - a function of the context keys each block forward read (moved ones on the decoder).
            (c0, r0), (c1, r1) = before, (_drafting(cons), _drafting(ref))
            counts = [b - a for a, b in zip(c0[0], c1[0])]
            assert counts == [b - a for a, b in zip(r0[0], r1[0])] and counts[1] > 0
            assert all(abs((a1 - a0) - (b1 - b0)) < 1e-3 for a0, a1, b0, b1 in zip(c0[1], c1[1], r0[1], r1[1]))
        # Decode-side preemption: a decoder whose replicas hold 5 blocks (40 tokens) each reads four prompts and
        # decodes 12 tokens of each (up to 4 blocks a request, with the k = 2 lookahead): it preempts, the preempted
        # requests recompute here (never read again), and the tokens stay one process's, with both pools whole.
        small = LLM(str(ck), kv_transfer_config=json.dumps(kt), **{**dep, "num_kv_blocks": 5})
        try:
            _check_pd({"prod": push, "GET": small, "ref": ref}, "GET", random_prompts(6, [16, 12, 10, 8]), n=12)
            assert small.engine.stats().num_preemptions > 0
        finally:
            small.engine.shutdown()
    finally:
        for llm in (pull, push, ref):
            llm.engine.shutdown()


def _rounds_with_prefix_hits(engines: dict, cons, send_type: str, seed: int) -> None:
    """Three prompts past the window (released window blocks move too), then three resuming inside them: the decoder
    resumes past its own cached blocks, and both producer replicas served."""
    first = random_prompts(seed, [40, 21, 33])
    _check_pd(engines, send_type, first)
    hits = cons.engine.stats().prefix_cache_hits
    more = random_prompts(seed + 10, [9, 12, 5])
    held = _check_pd(engines, send_type, [p[:32] + q for p, q in zip(first, more)])
    assert cons.engine.stats().prefix_cache_hits > hits  # the decoder resumed past its own cached blocks
    assert len({h.kv_transfer_params["remote_engine_id"] for h in held}) == 2


def _drafting(llm) -> tuple[tuple[int, int, int], list[float]]:
    s = llm.engine.stats().spec_decode
    return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens), s.confidence_per_pos + [0.0] * 4
