"""Anthropic's Messages API with the official ``anthropic`` client: text, system, tools (any / named tool,
tool_use + tool_result round trip), streaming events equal to the non-streaming message, count_tokens, and 400s
in Anthropic's error shape naming the field."""
from __future__ import annotations

import anthropic
import httpx
import pytest

from helpers import make_dense_checkpoint
from server_utils import InProcessServer

WEATHER = {"name": "get_weather", "description": "weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                             "required": ["tz"], "additionalProperties": False}}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
GREEDY = {"temperature": 0}  # this client version has no temperature argument; the server reads it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_dense_checkpoint(tmp_path_factory.mktemp("anthropic"), "llama", max_position_embeddings=512)
    with InProcessServer(ckpt, dtype="float32", max_model_len=512, num_kv_blocks=256) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def test_text_and_system(client):
    msg = client.messages.create(model="tiny", max_tokens=12, system="be brief", messages=MESSAGES,
                                 extra_body=GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens <= 12
    assert [b.type for b in msg.content] in (["text"], [])
    assert msg.usage.input_tokens == client.messages.count_tokens(
        model="tiny", system="be brief", messages=MESSAGES).input_tokens


@pytest.mark.parametrize("tool_choice, names", [({"type": "any"}, {"get_weather", "get_time"}),
                                                ({"type": "tool", "name": "get_weather"}, {"get_weather"})])
def test_tools_and_streaming(client, tool_choice, names):
    kw = dict(model="tiny", max_tokens=200, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=tool_choice,
              extra_body=GREEDY)
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and all(b.name in names and b.id.startswith("toolu_") for b in uses)
    for b in uses:
        schema = (WEATHER if b.name == "get_weather" else TIME)["input_schema"]
        assert set(b.input) == set(schema["required"])
    with client.messages.stream(**kw) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "content_block_stop" in events
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == \
        [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in msg.content]


def test_tool_result_round_trip(client):
    msg = client.messages.create(model="tiny", max_tokens=100, messages=MESSAGES, tools=[WEATHER],
                                 tool_choice={"type": "any"}, extra_body=GREEDY)
    use = next(b for b in msg.content if b.type == "tool_use")
    history = MESSAGES + [{"role": "assistant", "content": msg.content},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": "sunny, 21C"}]}]
    reply = client.messages.create(model="tiny", max_tokens=8, messages=history, tools=[WEATHER], extra_body=GREEDY)
    assert reply.stop_reason in ("end_turn", "max_tokens")


def test_text_stream_matches(client):
    kw = dict(model="tiny", max_tokens=20, messages=MESSAGES, extra_body=GREEDY)
    text = "".join(client.messages.create(**kw).content[0].text for _ in [0])
    with client.messages.stream(**kw) as s:
        assert "".join(s.text_stream) == text


@pytest.mark.parametrize("body, words", [
    ({"messages": MESSAGES}, "max_tokens is required"),
    ({"max_tokens": 5, "messages": []}, "messages must be a non-empty list"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 5, "messages": MESSAGES, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "'nope', which is not among the tools"),
    ({"max_tokens": 5, "messages": MESSAGES, "tools": [{"description": "no name"}]}, "tools.0.name"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "source.type must be 'base64' or 'url'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}]}]},
     "this model takes no image input"),
])
def test_bad_requests_are_anthropic_400s(server, body, words):
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert words in err["error"]["message"], err


def test_the_client_raises_on_a_400(client):
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        client.messages.create(model="tiny", max_tokens=5, messages=MESSAGES, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "nope"})
