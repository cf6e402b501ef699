"""logit_bias, allowed_token_ids and bad_words: validated (ValueError / HTTP 400 naming the field), applied by the
sampler to plain and speculative rows alike, offline and through the server."""
from __future__ import annotations

import httpx
import pytest
import torch

from helpers import make_dense_checkpoint
from openinfer import LLM, SamplingParams
from openinfer.worker.sampler import SamplingRow, sample
from server_utils import InProcessServer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# A repetitive prompt: n-gram lookup proposes drafts from the first step.
PROMPT = "abcabcabcabcabcabcabc"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_dense_checkpoint(tmp_path_factory.mktemp("tc"), "llama", max_position_embeddings=256)


@pytest.fixture(scope="module", params=["plain", "ngram"])
def llm(request, ckpt):
    kw = {"speculative_config": NGRAM} if request.param == "ngram" else {}
    return LLM(str(ckpt), dtype="float32", max_model_len=256, num_kv_blocks=64, **kw)


def gen(llm: LLM, **kw) -> list[int]:
    sp = SamplingParams(max_tokens=24, ignore_eos=True, **{"temperature": 0.0, **kw})
    return llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids


def test_sampler_applies_each_rule():
    logits = torch.zeros(3, 8)
    logits[:, 0] = 5.0
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={3: 100.0}), [], []),
            SamplingRow(SamplingParams(temperature=0, allowed_token_ids=[6, 7]), [], []),
            SamplingRow(SamplingParams(temperature=0, bad_words_token_ids=[[0], [4, 5]]), [], [1, 4])]
    logits[2, 5] = 4.0
    tokens, _ = sample(logits, rows)
    # row 2: 0 is banned outright; 5 is banned because the output ends with 4 (the word's prefix)
    assert tokens.tolist() == [3, 6, 1]
    rows[2].output_token_ids = [1, 2]  # the prefix no longer matches: 5 is allowed again
    assert sample(logits, rows)[0].tolist()[2] == 5


def test_grammar_mask_wins_when_the_other_rules_ban_everything_it_allows():
    mask = torch.zeros(8, dtype=torch.bool)
    mask[2] = True
    row = SamplingRow(SamplingParams(temperature=0, allowed_token_ids=[5]), [], [], allowed_mask=mask)
    assert sample(torch.zeros(1, 8), [row])[0].tolist() == [2]


def test_allowed_token_ids_and_logit_bias(llm):
    tok = llm.engine.tokenizer
    allowed = tok.encode("xyz", add_special_tokens=False)
    assert set(gen(llm, allowed_token_ids=allowed)) <= set(allowed)
    sampled = gen(llm, allowed_token_ids=allowed, temperature=1.0, seed=3)
    assert set(sampled) <= set(allowed)
    q = tok.encode("q", add_special_tokens=False)[0]
    assert gen(llm, logit_bias={q: 100.0}) == [q] * 24
    assert q not in gen(llm, logit_bias={q: -100.0}, allowed_token_ids=allowed + [q])


def test_bad_words_never_appear(llm):
    plain = llm.engine.tokenizer.decode(gen(llm))
    words = sorted({plain[i:i + 2] for i in range(0, len(plain) - 1)})[:3]
    assert words
    out = llm.engine.tokenizer.decode(gen(llm, bad_words=words))
    assert not any(w in out for w in words), (words, out)


@pytest.mark.parametrize("kw, field", [
    (dict(logit_bias={1: 101.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_out_of_vocab_ids_are_rejected_by_the_engine(llm):
    for kw, field in ((dict(logit_bias={10_000: 1.0}), "logit_bias"), (dict(allowed_token_ids=[10_000]),
                                                                          "allowed_token_ids")):
        with pytest.raises(ValueError, match=field):
            llm.generate([PROMPT], SamplingParams(**kw), use_tqdm=False)


def test_server_accepts_and_validates(ckpt):
    with InProcessServer(ckpt, dtype="float32", max_model_len=256, num_kv_blocks=64) as s:
        q = "113"  # a token id: JSON object keys are strings
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logit_bias": {q: 100},
                "return_token_ids": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == [113] * 8
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "allowed_token_ids": [40, 41], "bad_words": ["zz"], "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert set(r.json()["choices"][0]["token_ids"]) <= {40, 41}
        for extra, field in (({"logit_bias": {"a": 1}}, "logit_bias"), ({"logit_bias": {"1": 500}}, "logit_bias"),
                             ({"logit_bias": {"99999": 1}}, "logit_bias"),
                             ({"allowed_token_ids": [99999]}, "allowed_token_ids"),
                             ({"bad_words": [""]}, "bad_words")):
            r = httpx.post(s.url + "/v1/completions", json={**body, **extra}, timeout=60)
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == field, r.json()
