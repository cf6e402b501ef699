"""The one request validator (openinfer/server/request_validation.py), without a server or an engine: each API's
bad input is a 400 naming its field (and the limit), and what passes becomes the engine request."""
from __future__ import annotations

import asyncio

import pytest

from openinfer.request_limits import RequestLimits
from openinfer.sampling_params import SamplingParams
from openinfer.server.errors import APIError
from openinfer.server.protocol import ChatCompletionRequest, CompletionRequest
from openinfer.server.request_validation import RequestValidator
from openinfer.server.tool_parsers import get_tool_parser

MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def validator() -> RequestValidator:
    return RequestValidator(served_model_names=["tiny"], model_aliases=("/models/tiny",), max_model_len=100,
                            vocab_size=256, kv_capacity_tokens=80, max_sequences=6, max_token_chars=2,
                            limits=RequestLimits(max_stop_strings=3),
                            defaults=SamplingParams(temperature=0.6, top_p=0.9),
                            tool_parser=get_tool_parser("hermes"))


def run(coro):
    return asyncio.run(coro)


def completion(v: RequestValidator, **body):
    return run(v.check_completion(CompletionRequest.model_validate({"prompt": "hello", **body})))


def chat(v: RequestValidator, **body):
    return run(v.check_chat(ChatCompletionRequest.model_validate({"messages": MSG, **body})))


def messages(v: RequestValidator, **body):
    return run(v.check_messages({"max_tokens": 5, "messages": MSG, **body}))


def admitted(v: RequestValidator, step1, **body):
    """Both steps, with a short prompt: min_tokens against max_tokens is checked with the resolved max_tokens."""
    return v.engine_request(step1(v, **body), "r", [1, 2, 3])


def refused(fn, *args, **kw) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args, **kw)
    assert e.value.status == 400
    return e.value


# (body, param, words in the message)
COMPLETION_CASES = [
    (dict(model="gpt-9"), "model", "The model `gpt-9` does not exist"),
    (dict(n=0), "n", "n must be an integer >= 1"),
    (dict(n=7), "n", "asks for 7 sequences (1 prompt, n=7) but the server holds at most 6"),
    (dict(prompt=["a", "b", "c", "d"], n=2), "prompt", "asks for 8 sequences (4 prompts, n=2)"),
    (dict(best_of=3), "best_of", "best_of is not supported"),
    (dict(stop=["a", "b", "c", "d"]), "stop", "stop has 4 items, more than the limit of 3"),
    (dict(stop=["x" * 300]), "stop", "more than the limit of 256"),
    (dict(logprobs=21), "logprobs", "logprobs must be in [0, 20], got 21"),
    (dict(prompt_logprobs=-1), "prompt_logprobs", "prompt_logprobs must be in [0, 20]"),
    (dict(suffix="x"), "suffix", "suffix is not supported"),
    (dict(prompt=""), "prompt", "non-empty"),
    (dict(prompt=[]), "prompt", "must not be empty"),
    (dict(max_tokens=0), "max_tokens", "max_tokens must be at least 1, got 0"),
    (dict(temperature=-1), "temperature", "temperature must be >= 0"),
    (dict(top_p=1.5), "top_p", "top_p must be in (0, 1]"),
    (dict(top_k=-3), "top_k", "top_k"),
    (dict(min_p=2.0), "min_p", "min_p must be in [0, 1]"),
    (dict(presence_penalty=3.0), "presence_penalty", "in [-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "in (0, 10]"),
    (dict(seed=2**64), "seed", "seed must be a 64-bit integer"),
    (dict(min_tokens=10, max_tokens=4), "min_tokens", "min_tokens (10) must be <= max_tokens (4)"),
    (dict(stop_token_ids=[300]), "stop_token_ids", "outside the vocabulary [0, 256)"),
    (dict(logit_bias={"5": 500.0}), "logit_bias", "biases in [-100, 100]"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one"),
    (dict(structured_outputs={"jsn": {}}), "structured_outputs", "unknown keys"),
    (dict(kv_transfer_params={}, prompt=["a", "b"]), "kv_transfer_params", "moves one prompt's KV"),
]


@pytest.mark.parametrize("body, param, words", COMPLETION_CASES, ids=[c[1] + "-" + str(i)
                                                                      for i, c in enumerate(COMPLETION_CASES)])
def test_completion_refusals_name_the_field(validator, body, param, words):
    e = refused(admitted, validator, completion, **body)
    assert e.param == param and words in e.message, (e.param, e.message)


CHAT_CASES = [
    (dict(messages=[]), "messages", "messages must be a non-empty list"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role", "role must be one of"),
    (dict(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]), "messages.0.content",
     "only text (and image_url) content parts"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages.0.content.0.image_url",
     "this model takes no image input"),
    (dict(logprobs=True, top_logprobs=25), "top_logprobs", "top_logprobs must be in [0, 20], got 25"),
    (dict(top_logprobs=2), "top_logprobs", "requires logprobs=true"),
    (dict(continue_final_message=True), "continue_final_message", "cannot both be true"),
    (dict(max_completion_tokens=0), "max_completion_tokens", "max_completion_tokens must be at least 1"),
    (dict(max_tokens=-5), "max_tokens", "max_tokens must be at least 1"),
    (dict(n=7), "n", "asks for 7 sequences"),
    (dict(messages=[{"role": "user", "content": "x" * 201}]), "messages", "201 characters of input, more than the 200"),
    (dict(tool_choice="required"), "tool_choice", "tool_choice needs tools"),
    (dict(tools=[{"type": "function"}]), "tools.0.function", "tools.0.function must be an object"),
    (dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice.function.name",
     "'g', which is not among the tools"),
    (dict(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "cannot be combined with a response format"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema", "must be an object"),
    (dict(response_format={"type": "yaml"}), "response_format.type", "yaml"),
    (dict(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}), "structured_outputs",
     "not both"),
    (dict(temperature=-0.5), "temperature", "temperature must be >= 0"),
]


@pytest.mark.parametrize("body, param, words", CHAT_CASES, ids=[c[1] + "-" + str(i) for i, c in enumerate(CHAT_CASES)])
def test_chat_refusals_name_the_field(validator, body, param, words):
    e = refused(admitted, validator, chat, **body)
    assert e.param == param and words in e.message, (e.param, e.message)


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
def test_a_message_without_content_is_refused(validator, role):
    """OpenAI answers 400 for these (content is required); the chat template would otherwise see an empty turn."""
    for message in ({"role": role}, {"role": role, "content": None}):
        e = refused(chat, validator, messages=[*MSG, message])
        assert e.param == "messages.1.content" and e.code == "missing_required_parameter", e.message
        assert "Missing required parameter: 'messages[1].content'" in e.message


def test_an_assistant_message_without_content_needs_tool_calls(validator):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for message in ({"role": "assistant"}, {"role": "assistant", "content": None},
                    {"role": "assistant", "content": None, "tool_calls": []}):
        e = refused(chat, validator, messages=[*MSG, message])
        assert e.param == "messages.1.content" and "only when it has tool_calls" in e.message
    checked = chat(validator, messages=[*MSG, {"role": "assistant", "tool_calls": [call]},
                                        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}])
    assert checked.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    legacy = {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}  # OpenAI accepts it too
    assert chat(validator, messages=[*MSG, legacy, *MSG]).messages[1]["content"] == ""
    assert chat(validator, messages=[*MSG, {"role": "user", "content": ""}]).messages[1]["content"] == ""


@pytest.mark.parametrize("message, param, code", [
    ({"role": "tool", "content": "ok"}, "messages.1.tool_call_id", "missing_required_parameter"),
    ({"role": "tool", "content": "ok", "tool_call_id": 7}, "messages.1.tool_call_id", "invalid_type"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
     "messages.1.tool_calls.0.id", "missing_required_parameter"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "x", "function": {"name": "f", "arguments": "{}"}}]},
     "messages.1.tool_calls.0.type", "invalid_value"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]},
     "messages.1.tool_calls.0.function", "missing_required_parameter"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": "f"}]},
     "messages.1.tool_calls.0.function", "invalid_type"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]},
     "messages.1.tool_calls.0.function.name", "missing_required_parameter"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]},
     "messages.1.tool_calls.0.function.arguments", "missing_required_parameter"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                           "function": {"name": "f", "arguments": {"a": 1}}}]},
     "messages.1.tool_calls.0.function.arguments", "invalid_type"),
])
def test_openais_other_required_message_fields(validator, message, param, code):
    """OpenAI's chat schema: a tool message needs tool_call_id; an assistant's tool_calls each need id, type
    'function' and function.name / function.arguments (a JSON string). 400 naming the field, as OpenAI answers."""
    e = refused(chat, validator, messages=[*MSG, message])
    assert (e.param, e.code) == (param, code), e.message


MESSAGES_CASES = [
    (dict(max_tokens=None), "max_tokens", "max_tokens is required"),
    (dict(messages=[]), "messages", "messages must be a non-empty list"),
    (dict(messages=[{"role": "system", "content": "x"}]), "messages.0.role", "must be 'user' or 'assistant'"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "messages.0.content.0.source.type", "must be 'base64' or 'url', got None"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type":
                                                                              "image/png", "data": "aGk="}}]}]),
     "messages.0.content.0.image_url", "this model takes no image input"),
    (dict(messages=[{"role": "user", "content": [{"type": "audio"}]}]), "messages.0.content.0",
     "unsupported content block 'audio'"),
    (dict(tools=[{"description": "no name"}]), "tools.0.name", "must be an object with a name"),
    (dict(tools=[{"name": "f"}], tool_choice={"type": "tool", "name": "g"}), "tool_choice.function.name",
     "'g', which is not among the tools"),
    (dict(tool_choice={"type": "sometimes"}), "tool_choice", "tool_choice must be"),
    (dict(max_tokens=0), "max_tokens", "max_tokens must be at least 1"),
    (dict(stop_sequences=["a", "b", "c", "d"]), "stop", "stop has 4 items, more than the limit of 3"),
    (dict(temperature=-1), "temperature", "temperature must be >= 0"),
    (dict(model="claude-9"), "model", "does not exist"),
]


@pytest.mark.parametrize("body, param, words", MESSAGES_CASES,
                         ids=[c[1] + "-" + str(i) for i, c in enumerate(MESSAGES_CASES)])
def test_messages_refusals_name_the_field(validator, body, param, words):
    e = refused(admitted, validator, messages, **body)
    assert e.param == param and words in e.message, (e.param, e.message)


def test_prompt_ids_and_the_context(validator):
    checked = completion(validator, max_tokens=30)
    for ids, param, words in (([], "prompt", "empty"), ([5] * 100, "prompt", "your request has 100 input tokens"),
                              ([5, 256], "prompt", "token id 256 is out of range"),
                              ([5] * 80, "max_tokens", "you requested 110 tokens (80 in the messages, 30 in")):
        e = refused(validator.engine_request, checked, "r", ids)
        assert e.param == param and words in e.message, e.message
    e = refused(validator.engine_request, chat(validator, max_completion_tokens=30), "r", [5] * 80)
    assert e.param == "max_completion_tokens" and e.code == "context_length_exceeded"
    e = refused(validator.engine_request, chat(validator, min_tokens=30), "r", [5] * 60)
    assert e.param == "min_tokens" and "min_tokens (30) must be <= max_tokens (20)" in e.message


def test_what_passes_becomes_the_engine_request(validator):
    checked = completion(validator, model="/models/tiny", prompt=["ab", "cd"], n=2, echo=True, logprobs=2,
                         max_tokens=7, stop="x", logit_bias={"3": 1.5})
    assert checked.model == "tiny" and checked.prompts == ["ab", "cd"]
    add = validator.engine_request(checked, "r-0", [1, 2, 3], "ab", 1.5)
    p = add.params
    assert (add.request_id, add.prompt_token_ids, add.prompt, add.arrival_s) == ("r-0", [1, 2, 3], "ab", 1.5)
    assert (p.n, p.max_tokens, p.logprobs, p.prompt_logprobs, p.stop, p.logit_bias) == (2, 7, 2, 2, ["x"], {3: 1.5})
    assert (p.temperature, p.top_p) == (0.6, 0.9)  # the model's defaults under what the request leaves out
    assert checked.params.max_tokens is None  # shared by the prompts: each gets its own max_tokens
    # chat without max_tokens: whatever room the prompt leaves, within the KV pool (80 tokens here)
    add = validator.engine_request(chat(validator, temperature=0.0), "c", [5] * 10)
    assert add.params.max_tokens == 70 and add.params.temperature == 0.0
    checked = messages(validator, system="be brief", stop_sequences=["END"], top_k=5)
    assert checked.messages[0] == {"role": "system", "content": "be brief"}
    add = validator.engine_request(checked, "m", [5] * 10)
    assert (add.params.max_tokens, add.params.stop, add.params.top_k) == (5, ["END"], 5)


def test_count_tokens_needs_no_max_tokens(validator):
    checked = run(validator.check_messages({"messages": MSG}, count_only=True))
    assert checked.max_tokens is None


def test_a_raised_request_limit_holds_through_the_engine(tmp_path_factory):
    """--max-stop-strings past the default: the engine, which checks each request again, uses the server's caps
    (it refused with its default ones, a 400 naming no field)."""
    import httpx
    from server_utils import InProcessServer, shared_checkpoint

    with InProcessServer(shared_checkpoint(tmp_path_factory), dtype="float32", max_model_len=256, num_kv_blocks=64,
                         server_kw={"limits": RequestLimits(max_stop_strings=100)}) as s:
        body = {"prompt": "hello", "max_tokens": 2, "stop": [f"s{i}" for i in range(80)]}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(s.url + "/v1/completions", json={**body, "stop": [f"s{i}" for i in range(101)]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
