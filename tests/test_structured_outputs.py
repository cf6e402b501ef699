"""Structured outputs offline: every output under a JSON schema (hypothesis-generated), regex, choice or grammar
matches it - plain decoding, n > 1, sampling, and n-gram speculative decoding (drafts checked against the mask,
rejected ones rolled back); grammars compile off the step loop (the request waits, others run); bad grammars are
a ValueError naming the field; the matcher's draft rows leave its state as it was."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import make_dense_checkpoint
from openinfer import LLM, SamplingParams
from openinfer.sampling_params import StructuredOutputsParams as SO
from openinfer.structured_outputs.backend import MAX_GRAMMAR_CHARS, make_backend
from schema_strategies import json_schemas, max_json_chars

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = ['{"a": 1, "b": [true, false]} {"a": 1, "b": [', "hello", '[1, 2, 3] {"x": "yes"} {"x": "']


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_dense_checkpoint(tmp_path_factory.mktemp("so"), "llama", max_position_embeddings=512)


# Both grammar backends (the test command installs xgrammar without its triton dependency), plain and with drafts.
@pytest.fixture(scope="module", params=[("llguidance", "plain"), ("llguidance", "ngram"), ("xgrammar", "plain"),
                                        ("xgrammar", "ngram")], ids="-".join)
def llm(request, ckpt):
    backend, mode = request.param
    kw = {"speculative_config": NGRAM} if mode == "ngram" else {}
    return LLM(str(ckpt), dtype="float32", max_model_len=512, num_kv_blocks=256,
               structured_outputs_backend=backend, **kw)


def run(llm: LLM, spec: SO, n: int = 2, **kw) -> list:
    sp = SamplingParams(n=n, structured_outputs=spec, **{"max_tokens": 300, "temperature": 1.0, "seed": 0, **kw})
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    return [c for o in outs for c in o.outputs]


def test_schema_size_bound_covers_the_longest_instance():
    """The bound that keeps generated schemas inside the token budget, on the schema a CI run drew (4 x 4 objects):
    its longest compact instance must not exceed it, and it must exceed the 300-token budget (so it is filtered)."""
    obj = {"type": "object", "additionalProperties": False, "required": [],
           "properties": {k: {"type": "boolean"} for k in ("a", "ababh", "abh")}}
    schema = {"type": "array", "minItems": 0, "maxItems": 4,
              "items": {"type": "array", "minItems": 0, "maxItems": 4, "items": obj}}
    longest = [[{"a": False, "ababh": False, "abh": False}] * 4] * 4
    jsonschema.validate(longest, schema)
    assert 300 < len(json.dumps(longest, separators=(",", ":"))) <= max_json_chars(schema)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(json_schemas(max_chars=290), min_size=3, max_size=3), greedy=st.booleans())
def test_every_output_validates_against_its_schema(llm, schemas, greedy):
    params = [SamplingParams(n=2, max_tokens=300, temperature=0.0 if greedy else 1.0, seed=i,
                             structured_outputs=SO(json=s)) for i, s in enumerate(schemas)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for schema, out in zip(schemas, outs):
        for c in out.outputs:
            assert c.finish_reason == "stop", (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)


def test_json_is_compact(llm):
    """Both backends write compact JSON (no space after "," or ":"), the form max_json_chars bounds: xgrammar's
    separators were json.dumps' ", " and ": ", so a CI run's 4 x 3 objects ({"a": true, "aa": true}), inside
    the bound when compact, ran past the 300-token budget (finish_reason "length")."""
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"type": "boolean"}, "b": {"type": "array", "items": {"type": "boolean"}}}}
    tok = llm.get_tokenizer()
    grammar = llm.engine.grammar_compiler.backend.compile(SO(json=schema))

    def accepts(text: str) -> bool:
        matcher = grammar.new_matcher()
        return all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False))

    assert accepts('{"a":true,"b":[false,true]}')
    assert not accepts('{"a": true,"b":[false,true]}') and not accepts('{"a":true, "b":[false,true]}')
    assert not accepts('{"a":true,"b":[false, true]}')


def test_json_strings_never_hold_raw_control_characters(llm):
    """Strict JSON escapes U+0000-U+001F inside strings. xgrammar's string rule admits a raw tab (its characters
    are [^"\\\r\n]); the backend takes such tokens out of JSON masks. A logit bias makes the tab the model's
    favourite token, so without that this fails every time."""
    tok = llm.get_tokenizer()
    tab = tok.encode("\t", add_special_tokens=False)
    assert len(tab) == 1
    schema = {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2}
    for spec in (SO(json=schema), SO(json_object=True)):
        sp = SamplingParams(n=2, max_tokens=60, temperature=1.0, seed=3, logit_bias={tab[0]: 50.0},
                            structured_outputs=spec)
        for o in llm.generate(PROMPTS, sp, use_tqdm=False):
            for c in o.outputs:
                assert not any(ord(ch) < 0x20 for ch in c.text), repr(c.text)
                if c.finish_reason == "stop":
                    json.loads(c.text)


def test_speculative_drafts_are_checked_against_the_grammar(ckpt):
    """The n-gram proposer drafts from the prompt, whose text breaks the schema: drafts are proposed, most are
    cut or rejected, and the outputs still validate."""
    llm = LLM(str(ckpt), dtype="float32", max_model_len=512, num_kv_blocks=256, speculative_config=NGRAM)
    schema = {"type": "array", "items": {"type": "boolean"}, "maxItems": 8}
    for c in run(llm, SO(json=schema), temperature=0.0):
        jsonschema.validate(json.loads(c.text), schema)
    assert llm.engine.stats().spec_decode.num_drafts > 0


@pytest.mark.parametrize("spec, check", [
    (SO(regex=r"[a-c]{2,4}-\d{1,3}"), lambda t: re.fullmatch(r"[a-c]{2,4}-\d{1,3}", t)),
    (SO(choice=["yes", "no", "maybe not"]), lambda t: t in ("yes", "no", "maybe not")),
    (SO(grammar='start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'),
     lambda t: re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", t)),
    (SO(grammar='root ::= "x" [0-9] [0-9]? "y"'), lambda t: re.fullmatch(r"x\d\d?y", t)),  # EBNF / GBNF
])
def test_regex_choice_grammar(llm, spec, check):
    if llm.engine.grammar_compiler.backend.name == "xgrammar" and spec.grammar and "::=" not in spec.grammar:
        with pytest.raises(ValueError, match=r"structured_outputs.grammar looks like Lark .* llguidance"):
            run(llm, spec)
        return
    for c in run(llm, spec) + run(llm, spec, temperature=0.0):
        assert c.finish_reason == "stop" and check(c.text), c.text


def test_json_object(llm):
    """Any object: unbounded, so a random model may run out of tokens inside a key; every output that ended by
    itself is an object."""
    outs = run(llm, SO(json_object=True), n=4, max_tokens=120, seed=None)
    stopped = [c for c in outs if c.finish_reason == "stop"]
    assert stopped
    for c in stopped:
        assert isinstance(json.loads(c.text), dict), c.text


@pytest.mark.parametrize("spec, field", [
    (dict(json={"type": "wat"}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(regex="a(b"), "structured_outputs.regex"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (dict(grammar="start: " + " | ".join(f'"{i}"' for i in range(MAX_GRAMMAR_CHARS // 4))),
     "structured_outputs.grammar is too large"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(json={}, regex="a"), "exactly one of"),
])
def test_bad_grammars_name_the_field(llm, spec, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["x"], SamplingParams(structured_outputs=SO(**spec)), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_draft_rows_leave_the_matcher_where_it_was(llm):
    """step_bitmask accepts the drafts to fill their rows and rolls them back; valid_drafts cuts at the first
    draft the grammar refuses."""
    from openinfer.structured_outputs.manager import RequestGrammar

    tok = llm.engine.tokenizer
    compiler = llm.engine.grammar_compiler
    fut = compiler.submit(SO(regex="ab+c"))
    fut.result()
    g = RequestGrammar(fut)
    assert g.ready
    a, b, c, x = (tok.encode(ch, add_special_tokens=False)[0] for ch in "abcx")
    assert g.valid_drafts([a, b, x, b]) == [a, b]
    first = g.step_bitmask([])
    rows = g.step_bitmask([a, b])
    assert len(rows) == 3 * len(first) and rows[:len(first)] == first
    assert g.step_bitmask([]) == first  # rolled back
    for t in (a, b, c):
        assert g.accept(t)
    if not g.is_terminated:  # xgrammar ends on the stop token; llguidance as soon as the grammar is complete
        mask = int.from_bytes(g.step_bitmask([]), "little")
        allowed = [i for i in range(mask.bit_length()) if mask >> i & 1]
        assert allowed == [tok.eos_token_id]
        assert g.accept(tok.eos_token_id)
    assert g.is_terminated


def test_a_compiling_grammar_waits_without_holding_others_back(ckpt, monkeypatch):
    """A slow compile keeps its request waiting; the plain request behind it finishes meanwhile; a compile that
    fails inside the core ends its request with an error (never a stuck request)."""
    llm = LLM(str(ckpt), dtype="float32", max_model_len=512, num_kv_blocks=64)
    backend = llm.engine.grammar_compiler.backend
    gate = threading.Event()
    real = backend.compile

    def slow_compile(spec):
        gate.wait(30)
        if spec.regex == "fail":
            raise ValueError("structured_outputs.regex is invalid: boom")
        return real(spec)

    monkeypatch.setattr(backend, "compile", slow_compile)
    eng = llm.engine
    eng.add_request("slow", "x", SamplingParams(max_tokens=5, structured_outputs=SO(regex="[ab]{3}")))
    eng.add_request("bad", "x", SamplingParams(max_tokens=5, structured_outputs=SO(regex="fail")))
    eng.add_request("plain", "x", SamplingParams(max_tokens=3, ignore_eos=True))
    finished = {}
    for _ in range(50):
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
        if "plain" in finished:
            break
    assert set(finished) == {"plain"} and eng.stats().num_waiting == 2
    gate.set()
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert re.fullmatch("[ab]{3}", finished["slow"].outputs[0].text)
    assert finished["bad"].outputs[0].finish_reason == "error"
    kv = eng.core.kv
    assert kv.groups[0].pool.num_free_blocks == kv.num_blocks["full"] - 1 or kv.usage == 0.0


def test_backend_seam():
    with pytest.raises(ValueError, match="choose one of auto, llguidance, xgrammar"):
        make_backend("outlines", None, 8, [])


def test_missing_xgrammar_is_a_clear_error(monkeypatch):
    import openinfer.structured_outputs.xgrammar_backend as xb

    monkeypatch.setattr(xb, "xgr", None)
    with pytest.raises(ValueError, match=r"pip install 'openinfer\[xgrammar\]'"):
        make_backend("xgrammar", None, 8, [])
