"""Structured outputs through the server: response_format json_schema / json_object and structured_outputs
(regex, choice, grammar) on chat and completions, n > 1, with and without n-gram speculative decoding; every
bad constraint is a 400 naming the field, and the server keeps serving."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import make_dense_checkpoint
from schema_strategies import json_schemas
from server_utils import InProcessServer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_dense_checkpoint(tmp_path_factory.mktemp("sos"), "llama", max_position_embeddings=512)


@pytest.fixture(scope="module", params=[("llguidance", "plain"), ("llguidance", "ngram"), ("xgrammar", "plain"),
                                        ("xgrammar", "ngram")], ids="-".join)
def server(request, ckpt):
    backend, mode = request.param
    kw = {"speculative_config": NGRAM} if mode == "ngram" else {}
    with InProcessServer(ckpt, dtype="float32", max_model_len=512, num_kv_blocks=256,
                         structured_outputs_backend=backend, **kw) as s:
        yield s


def chat(server, **body) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": '{"a": [1, 2]} {"a": ['}], "max_tokens": 300, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=json_schemas(max_chars=290), temperature=st.sampled_from([0.0, 1.0]))
def test_response_format_json_schema_validates(server, schema, temperature):
    r = chat(server, n=2, temperature=temperature, seed=5,
             response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_openai_client_and_streaming(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    client = server.client()
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=100, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(resp.choices[0].message.content), schema)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=100, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}) if c.choices)
    assert text == resp.choices[0].message.content


@pytest.mark.parametrize("so, check", [
    ({"regex": r"\d{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2}", t)),
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"grammar": 'start: "<" /[a-z]{1,3}/ (">" | "/>")'}, lambda t: re.fullmatch(r"<[a-z]{1,3}(>|/>)", t)),
])
def test_structured_outputs_on_completions_and_chat(server, so, check):
    if server.engine.grammar_compiler.backend.name == "xgrammar" and "::=" not in so.get("grammar", "::="):
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={"prompt": "x", "structured_outputs": so})
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.grammar", r.text
        return
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": "x", "n": 3, "max_tokens": 50, "temperature": 1.0, "seed": 1, "structured_outputs": so})
    assert r.status_code == 200, r.text
    assert all(c["finish_reason"] == "stop" and check(c["text"]) for c in r.json()["choices"]), r.json()
    r = chat(server, max_tokens=50, temperature=0, structured_outputs=so)
    assert r.status_code == 200 and check(r.json()["choices"][0]["message"]["content"]), r.text


def test_json_object(server):
    r = chat(server, n=3, max_tokens=150, temperature=1.0, response_format={"type": "json_object"})
    assert r.status_code == 200, r.text
    stopped = [c for c in r.json()["choices"] if c["finish_reason"] == "stop"]
    for c in stopped:
        assert isinstance(json.loads(c["message"]["content"]), dict)


@pytest.mark.parametrize("body, param, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}),
     "response_format", "Invalid type|Unsupported type"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema", "schema"),
    (dict(response_format={"type": "yaml"}), "response_format.type", "yaml"),
    (dict(structured_outputs={"regex": "a(b"}), "structured_outputs.regex", "unclosed group|not closed"),
    (dict(structured_outputs={"json": "{oops"}), "structured_outputs.json", "not valid JSON"),
    (dict(structured_outputs={"grammar": "start: nope"}), "structured_outputs.grammar", "nope|looks like Lark"),
    (dict(structured_outputs={"grammar": "start: " + "|".join(['"a"'] * 30000)}), "structured_outputs.grammar",
     "too large"),
    (dict(structured_outputs={"choice": []}), "structured_outputs.choice", "non-empty"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one"),
    (dict(structured_outputs={"jsn": {}}), "structured_outputs", "unknown keys"),
    (dict(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}), "structured_outputs",
     "not both"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param, words):
    r = chat(server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(words, err["message"]), err
    assert chat(server, max_tokens=2).status_code == 200  # still serving
