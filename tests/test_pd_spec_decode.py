"""Speculative decoding on the decode side of prefill/decode disaggregation (two in-process engines over real NIXL
on host memory, pull and push). The MTP layer's KV is part of the transfer: its stores are the ``mtp.*`` groups
of the same block manager, filled by the producer's prompt pass (which runs the same speculative_config), and the
decoder drafts from them at its first step - the same drafts, step for step, as one engine. n-gram has no KV.
A producer started without the drafter has another layout: the handshake names both sides' settings and the
decoder computes the prompt itself."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_kv_nixl_engines import drain_and_check_free, stepping

from openinfer.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

MTP = {"method": "mtp", "num_speculative_tokens": 2}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _engines(ck, spec, producer_spec):
    from openinfer.entrypoints.llm import LLM

    # 16-token steps: the producer and the reference prefill in chunks (the MTP layer's catch-up per chunk).
    kw = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=16, max_num_batched_tokens=16)

    def pd(role, spec, **extra):
        cfg = {"kv_connector": "NixlConnector", "kv_role": role, "load_timeout_s": 3.0, **extra}
        return LLM(str(ck), kv_transfer_config=json.dumps(cfg), speculative_config=spec, **kw)

    class Engines(dict):  # the push decoder only when a (slow) push case asks for it
        def __missing__(self, key):
            assert key == "PUT", key
            self[key] = pd("kv_consumer", spec, kv_connector_extra_config={"send_type": "PUT"})
            return self[key]

    return Engines(prod=pd("kv_producer", producer_spec), GET=pd("kv_consumer", spec),
                   ref=LLM(str(ck), speculative_config=spec, **kw))


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    pytest.importorskip("nixl")
    from make_deepseek_checkpoint import make_v3

    ck = make_v3(tmp_path_factory.mktemp("pd-mtp") / "v3", "tiny", overrides={"num_nextn_predict_layers": 1})
    engines = _engines(ck, MTP, MTP)
    yield engines
    for llm in engines.values():
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("nixl")
    from helpers import make_dense_checkpoint

    engines = _engines(make_dense_checkpoint(tmp_path_factory.mktemp("pd-ngram") / "llama"), NGRAM, None)
    yield engines
    for llm in engines.values():
        llm.engine.shutdown()


def _record_drafts(llm) -> list:
    """Every ``propose`` result of the engine's proposer, in step order (one request at a time: its drafts)."""
    proposer = llm.engine.core.executor.driver_worker.model_runner.proposer
    seen, propose = [], proposer.propose

    def recording(step):
        drafts = propose(step)
        if step.sampled:  # the steps that sample (a prompt's other chunks only catch the drafter up)
            seen.append(sorted(drafts.values()))
        return drafts

    proposer.propose = recording
    return seen


def _greedy(llm, prompt, n, params=None):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, kv_transfer_params=params)
    return llm.generate([prompt], sp, use_tqdm=False)[0]


def _pd(engines, send_type, prompts, n=10):
    """Each prompt through producer -> decoder and through the one-engine reference: (decoder, reference) tokens."""
    prod, cons, ref = engines["prod"], engines[send_type], engines["ref"]
    pairs = []
    for prompt in prompts:
        want = _greedy(ref, prompt, n)
        p = _greedy(prod, prompt, 1, {"do_remote_decode": True})
        with stepping(prod):
            got = _greedy(cons, prompt, n, p.kv_transfer_params)
        assert got.num_cached_tokens == len(prompt) - 1  # all but the last prompt token came over NIXL
        pairs.append((got.outputs[0].token_ids, want.outputs[0].token_ids))
    drain_and_check_free(prod, cons)
    return pairs


PUT_SLOW = ["GET", pytest.param("PUT", marks=pytest.mark.slow)]  # push: tests/test_kv_nixl_engines.py covers it fast


@pytest.mark.parametrize("send_type", PUT_SLOW)
def test_mtp_k2_on_the_decode_side_of_pd_deepseek_v3(v3, send_type):
    from helpers import random_prompts

    prompts = random_prompts(0, [40, 17, 5])
    prompts.append(prompts[0][:32] + prompts[1])  # its first two blocks are a prefix hit on the decoder
    cons, ref = v3[send_type], v3["ref"]
    assert [s.name for s in cons.engine.core.kv_specs] == ["full", "mtp.full"]
    got_drafts, want_drafts = _record_drafts(cons), _record_drafts(ref)
    try:
        before = cons.engine.stats()
        for got, want in _pd(v3, send_type, prompts):
            assert got == want
        # Drafts read the MTP layer's KV over the whole prompt: identical drafts, step for step, show that the
        # transferred mtp.full rows are the ones one engine computes (zeros there draft other tokens).
        assert got_drafts == want_drafts and any(got_drafts)
    finally:
        for llm in (cons, ref):
            del llm.engine.core.executor.driver_worker.model_runner.proposer.propose
    after = cons.engine.stats()
    assert after.kv_transfer.loads_ok - before.kv_transfer.loads_ok == 4
    assert after.prefix_cache_hits > before.prefix_cache_hits  # the last prompt read only past its local hit
    assert after.kv_transfer.fallbacks == before.kv_transfer.fallbacks
    assert after.spec_decode.num_draft_tokens > before.spec_decode.num_draft_tokens


@pytest.mark.parametrize("send_type", PUT_SLOW)
def test_ngram_on_the_decode_side_of_pd_llama(llama, send_type):
    phrase = [31, 32, 33, 34]
    prompts = [phrase * 5 + [7, 8], [77] * 17, list(range(10, 44))]
    cons = llama[send_type]
    before = cons.engine.stats().spec_decode
    for got, want in _pd(llama, send_type, prompts):
        assert got == want
    after = cons.engine.stats().spec_decode
    assert after.num_accepted_tokens > before.num_accepted_tokens  # the prompt's n-grams drafted accepted tokens


def test_a_producer_without_the_drafter_is_named_and_the_decoder_computes_the_prompt(v3, tmp_path, caplog):
    """A prefill instance started without speculative_config holds no MTP KV: the decoder's handshake fails naming
    both sides' settings, and it computes the prompt itself (same tokens), leaving no block behind on either side."""
    from helpers import random_prompts

    from openinfer.entrypoints.llm import LLM

    ck = v3["ref"].engine.config.model.path
    prod = LLM(ck, kv_transfer_config=json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}),
               dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=16)
    try:
        (prompt,) = random_prompts(5, [21])
        cons = v3["GET"]
        before = cons.engine.stats().kv_transfer
        p = _greedy(prod, prompt, 1, {"do_remote_decode": True})
        with caplog.at_level("WARNING"):
            got = _greedy(cons, prompt, 6, p.kv_transfer_params)
        assert got.outputs[0].token_ids == _greedy(v3["ref"], prompt, 6).outputs[0].token_ids
        assert got.num_cached_tokens == 0
        after = cons.engine.stats().kv_transfer
        assert after.fallbacks == before.fallbacks + 1 and after.loads_ok == before.loads_ok
        msg = next(r.getMessage() for r in caplog.records if "KV layouts differ" in r.getMessage())
        assert "speculative_config=none" in msg and "speculative_config=mtp k=2" in msg
        assert "['full']" in msg and "['full', 'mtp.full']" in msg
        drain_and_check_free(prod, cons)
    finally:
        prod.engine.shutdown()


@pytest.mark.slow  # two more engines
def test_draft_model_on_the_decode_side_of_pd(llama):
    """A draft model's own KV (the ``draft.*`` groups) travels too: with the target as its own draft every draft is
    accepted, which needs the draft's KV over the whole prompt on the decoder."""
    from helpers import random_prompts

    from openinfer.entrypoints.llm import LLM

    ck = llama["ref"].engine.config.model.path
    spec = {"method": "draft_model", "model": ck, "num_speculative_tokens": 2}
    kw = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=16, speculative_config=spec)
    engines = {"prod": LLM(ck, kv_transfer_config=json.dumps({"kv_connector": "NixlConnector",
                                                              "kv_role": "kv_producer"}), **kw),
               "GET": LLM(ck, kv_transfer_config=json.dumps({"kv_connector": "NixlConnector",
                                                             "kv_role": "kv_consumer"}), **kw),
               "ref": llama["ref"]}
    try:
        assert [s.name for s in engines["GET"].engine.core.kv_specs] == ["full", "draft.full"]
        for got, want in _pd(engines, "GET", random_prompts(6, [37, 9]), n=8):
            assert got == want
        s = engines["GET"].engine.stats().spec_decode
        assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens
    finally:
        for role in ("prod", "GET"):
            engines[role].engine.shutdown()


@pytest.mark.slow  # three V4 engines with the MTP block
def test_mtp_k2_on_the_decode_side_of_pd_deepseek_v4(tmp_path):
    """V4's MTP block is a module of the target too: its stores travel once, as the proposer's ``mtp.*`` groups
    (full, window with released blocks sent as -1, coarse), never as the target's."""
    from test_deepseek_v4 import _generator, _prompts, write_release_with_mtp

    from openinfer.entrypoints.llm import LLM

    hf_style = _generator().make_checkpoint(tmp_path / "tiny", "tiny", seed=0)
    write_release_with_mtp(hf_style, tmp_path / "release")
    kw = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=8, speculative_config=MTP,
              tokenizer=str(hf_style))
    kt = {"kv_connector": "NixlConnector"}
    engines = {"prod": LLM(str(tmp_path / "release"), kv_transfer_config=json.dumps({**kt, "kv_role": "kv_producer"}),
                           **kw),
               "GET": LLM(str(tmp_path / "release"), kv_transfer_config=json.dumps({**kt, "kv_role": "kv_consumer"}),
                          **kw),
               "ref": LLM(str(tmp_path / "release"), **kw)}
    try:
        cons, ref = engines["GET"], engines["ref"]
        assert [s.name for s in cons.engine.core.kv_specs] == ["full", "window", "coarse", "mtp.full", "mtp.window",
                                                               "mtp.coarse"]
        got_drafts, want_drafts = _record_drafts(cons), _record_drafts(ref)
        for got, want in _pd(engines, "GET", [p[:len(p) // 2] * 2 + p for p in _prompts(1, [17, 33])], n=8):
            assert got == want
        assert got_drafts == want_drafts and any(got_drafts)
        assert cons.engine.stats().kv_transfer.fallbacks == 0
    finally:
        for llm in engines.values():
            llm.engine.shutdown()


@pytest.mark.slow  # three V4.1 engines
def test_dspark_on_the_decode_side_of_pd_deepseek_v41(tmp_path):
    """DeepSeek-V4.1's MTP is DSpark: its context keys (the ``dspark.window`` group, filled from the target's features
    by the producer's prompt pass) travel with the target's window and full groups, pull and push, and the decoder
    drafts from them at its first step - the same drafts, step for step, as one engine. The producer runs without
    prefix caching (YOCO's shortened prefill would skip consumer-layer rows it hands on: test_kv_nixl_engines)."""
    from helpers import load_script, random_prompts

    from openinfer.entrypoints.llm import LLM

    ck = load_script("make_deepseek_v41_checkpoint").make_checkpoint(tmp_path / "v41", "tiny", seed=0,
                                                                      quantize=False)
    kw = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=8, speculative_config=MTP)

    def pd(role, **extra):
        return LLM(str(ck), kv_transfer_config=json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                                             "load_timeout_s": 3.0, **extra}), **kw)

    engines = {"prod": LLM(str(ck), kv_transfer_config=json.dumps({"kv_connector": "NixlConnector",
                                                                   "kv_role": "kv_producer"}),
                           enable_prefix_caching=False, **kw),
               "GET": pd("kv_consumer"), "PUT": pd("kv_consumer", kv_connector_extra_config={"send_type": "PUT"}),
               "ref": LLM(str(ck), **kw)}
    try:
        assert [s.name for s in engines["GET"].engine.core.kv_specs] == ["full", "window", "dspark.window"]
        for send_type, seed in (("GET", 7), ("PUT", 8)):
            cons, ref = engines[send_type], engines["ref"]
            got_drafts, want_drafts = _record_drafts(cons), _record_drafts(ref)
            try:
                for got, want in _pd(engines, send_type, random_prompts(seed, [40, 13]), n=8):
                    assert got == want
                assert got_drafts == want_drafts and any(got_drafts)
            finally:
                for llm in (cons, ref):
                    del llm.engine.core.executor.driver_worker.model_runner.proposer.propose
            s = cons.engine.stats()
            assert s.kv_transfer.fallbacks == 0 and s.spec_decode.num_draft_tokens > 0
    finally:
        for llm in engines.values():
            llm.engine.shutdown()
