"""Tool calling through the server with the official ``openai`` client (Hermes / Qwen format): tool_choice auto
(the model's own call parsed out), required and a named function (enforced by the grammar; parallel calls
unless parallel_tool_calls is false), streaming equal to non-streaming, reasoning_content split; malformed
tools and unknown tool names are 400s naming the field."""
from __future__ import annotations

import json

import httpx
import pytest

from helpers import make_dense_checkpoint
from openinfer.server.tool_parsers import HermesToolParser
from server_utils import InProcessServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_dense_checkpoint(tmp_path_factory.mktemp("tools"), "llama", max_position_embeddings=512)
    with InProcessServer(ckpt, dtype="float32", max_model_len=512, num_kv_blocks=256,
                         server_kw={"reasoning_parser": "qwen3"}) as s:
        yield s


def check_calls(calls, names: set[str]) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        args = json.loads(c.function.arguments)
        tool = WEATHER if c.function.name == "get_weather" else TIME
        assert set(args) == set(tool["function"]["parameters"]["required"])


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_required_and_named(server, tool_choice, names):
    client = server.client()
    resp = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                          max_tokens=200, temperature=1.0, seed=3, n=2)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls, names)
        if isinstance(tool_choice, dict):
            assert len(choice.message.tool_calls) == 1
    # streaming: the same calls (greedy, so the same text) and no content
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=200, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0]
    streamed, content, finish = [], "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            streamed += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in plain.message.tool_calls]
    assert [c.index for c in streamed] == list(range(len(streamed)))


def test_parallel_tool_calls_false_means_one_call(server):
    resp = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=200, temperature=1.0, seed=0, n=3)
    assert all(len(c.message.tool_calls) == 1 for c in resp.choices)


def test_auto_parses_the_models_own_calls(server):
    """auto leaves the model free; here a grammar makes this random model write one call (with some text and
    thinking before it), which the parser must find."""
    grammar = ('start: "<think>" /[a-z ]{1,8}/ "</think>" /[A-Za-z ]{1,10}/ "\\n" call\n'
               + HermesToolParser.constrained_grammar([WEATHER], 1).replace("start: call\n", ""))
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "temperature": 0,
        "structured_outputs": {"grammar": grammar}})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["reasoning_content"] and msg["content"] and "<" not in msg["content"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    # tool_choice none: the same text is plain content
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 200, "temperature": 0,
        "structured_outputs": {"grammar": grammar}})
    msg = r.json()["choices"][0]["message"]
    assert "tool_calls" not in msg and "<tool_call>" in msg["content"]


def test_tool_results_round_trip(server):
    """An assistant turn with tool_calls and a tool message are accepted in the history."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "days": 2}'}}
    msgs = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    resp = server.client().chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=5)
    assert resp.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function"}]), "tools.0.function"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "x"}}]), "tools.0.type"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools.0.function.name"),
    (dict(tools=[WEATHER, WEATHER]), "tools.1.function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
     "tools.0.function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                 "properties": {"a": {"type": "wat"}}}}}],
          tool_choice="required"), "tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(tools="get_weather"), "tools"),
])
def test_bad_tools_are_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
