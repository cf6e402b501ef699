"""Bad requests get the right 4xx in OpenAI's error shape, never a hang or a 500; the server serves normally
after. Server: API key, a 64 KiB body limit, and room for only 2 sequences (max_num_seqs 2, max_queue 0).

The app runs on a uvicorn thread of the test process (real HTTP on a real port): validation is the same code
either way, and the CLI/process path is exercised by the other server modules."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_utils import InProcessServer, shared_checkpoint

KEY = "sk-test-key"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with InProcessServer(
        shared_checkpoint(tmp_path_factory),
        api_key=KEY,
        max_queue=0,
        max_body_bytes=65536,
        dtype="float32",
        max_model_len=1024,
        num_kv_blocks=160,
        max_num_seqs=2,
    ) as s:
        yield s


def _cmpl(**kw):
    return ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4, **kw})


def _chat(**kw):
    return ("/v1/chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 4, **kw})


# (id, (path, body), expected status, substring of the message, expected param or None)
CASES = [
    (
        "context-length",
        _cmpl(prompt="x" * 1000, max_tokens=100),
        400,
        "maximum context length is 1024 tokens. However, you requested 1100 tokens (1000 in the messages, "
        "100 in the completion)",
        "max_tokens",
    ),
    ("prompt-too-long", _cmpl(prompt="x" * 1100), 400, "your request has 1100 input tokens", "prompt"),
    (
        "chat-context-length",
        _chat(messages=[{"role": "user", "content": "y" * 900}], max_completion_tokens=200),
        400,
        "maximum context length is 1024 tokens",
        "max_completion_tokens",
    ),
    ("max-tokens-type", _cmpl(max_tokens="abc"), 400, "max_tokens", "max_tokens"),
    ("temperature-type", _cmpl(temperature="hot"), 400, "temperature", "temperature"),
    ("stream-type", _chat(stream="yes"), 400, "stream", "stream"),
    ("messages-type", _chat(messages="hello"), 400, "messages", "messages"),
    ("seed-type", _cmpl(seed="x"), 400, "seed", "seed"),
    ("unknown-model", _cmpl(model="gpt-9"), 400, "The model `gpt-9` does not exist", "model"),
    ("empty-messages", _chat(messages=[]), 400, "messages must be a non-empty list", "messages"),
    ("logprobs-count", _cmpl(logprobs=21), 400, "logprobs must be in [0, 20]", "logprobs"),
    (
        "top-logprobs-count",
        _chat(logprobs=True, top_logprobs=25),
        400,
        "top_logprobs must be in",
        "top_logprobs",
    ),
    ("top-logprobs-without-logprobs", _chat(top_logprobs=2), 400, "requires logprobs=true", "top_logprobs"),
    ("prompt-logprobs-count", _cmpl(prompt_logprobs=50), 400, "prompt_logprobs", "prompt_logprobs"),
    ("missing-prompt", ("/v1/completions", {"model": "tiny"}), 400, "prompt", "prompt"),
    ("empty-prompt", _cmpl(prompt=""), 400, "non-empty", "prompt"),
    ("empty-prompt-list", _cmpl(prompt=[]), 400, "must not be empty", "prompt"),
    ("token-id-range", _cmpl(prompt=[5, 999999]), 400, "token id 999999 is out of range", "prompt"),
    ("max-tokens-zero", _cmpl(max_tokens=0), 400, "max_tokens must be at least 1", "max_tokens"),
    ("max-tokens-negative", _chat(max_tokens=-5), 400, "max_tokens must be at least 1", "max_tokens"),
    ("temperature-negative", _cmpl(temperature=-1), 400, "temperature must be >= 0", "temperature"),
    ("top-p-range", _cmpl(top_p=1.5), 400, "top_p must be in (0, 1]", "top_p"),
    ("top-k-range", _cmpl(top_k=-3), 400, "top_k", "top_k"),
    ("n-zero", _cmpl(n=0), 400, "n must be an integer >= 1", "n"),
    ("n-over-capacity", _cmpl(n=5), 400, "asks for 5 sequences", "n"),
    ("presence-penalty-range", _cmpl(presence_penalty=5), 400, "presence_penalty", "presence_penalty"),
    (
        "repetition-penalty-range",
        _cmpl(repetition_penalty=0),
        400,
        "repetition_penalty",
        "repetition_penalty",
    ),
    (
        "min-tokens-over-max",
        _cmpl(min_tokens=10, max_tokens=4),
        400,
        "min_tokens (10) must be <= max_tokens",
        None,
    ),
    ("empty-stop", _cmpl(stop=[""]), 400, "stop must be", "stop"),
    ("negative-stop-token", _cmpl(stop_token_ids=[-1]), 400, "stop_token_ids", "stop_token_ids"),
    ("unknown-role", _chat(messages=[{"role": "wizard", "content": "x"}]), 400, "role must be one of", None),
    # OpenAI answers 400 for a message without content, but for an assistant's that has tool_calls
    ("user-without-content", _chat(messages=[{"role": "user"}]), 400,
     "Missing required parameter: 'messages[0].content'", "messages.0.content"),
    ("tool-without-content", _chat(messages=[*MSG, {"role": "tool", "tool_call_id": "c", "content": None}]), 400,
     "Missing required parameter: 'messages[1].content'", "messages.1.content"),
    ("assistant-without-content-or-tool-calls", _chat(messages=[*MSG, {"role": "assistant"}, *MSG]), 400,
     "only when it has tool_calls", "messages.1.content"),
    (
        "image-part",
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "takes no image input",
        None,
    ),
    ("logit-bias-range", _cmpl(logit_bias={"5": 500}), 400, "logit_bias must be", "logit_bias"),
    ("logit-bias-key", _cmpl(logit_bias={"five": 1}), 400, "logit_bias keys must be token ids", "logit_bias"),
    ("suffix", _cmpl(suffix="tail"), 400, "suffix is not supported", "suffix"),
    ("tools-malformed", _chat(tools=[{"type": "function"}]), 400, "tools.0.function must be", "tools.0.function"),
    (
        "tool-choice-unknown",
        _chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function",
                                                                                      "function": {"name": "g"}}),
        400,
        "'g', which is not among the tools",
        "tool_choice.function.name",
    ),
    (
        "response-format",
        _chat(response_format={"type": "json_schema"}),
        400,
        "response_format.json_schema must be an object",
        "response_format.json_schema",
    ),
    ("best-of", _cmpl(best_of=3), 400, "best_of", "best_of"),
    ("continue-and-generation-prompt", _chat(continue_final_message=True), 400, "cannot both be true", None),
    (
        "nan-temperature",
        ("/v1/completions", '{"model": "tiny", "prompt": "x", "temperature": NaN}'),
        400,
        "temperature",
        "temperature",
    ),
    ("invalid-json", ("/v1/completions", '{"model": "tiny", "prompt": '), 400, "not valid JSON", None),
    ("body-not-object", ("/v1/chat/completions", "[1, 2]"), 400, "object", None),
    ("detokenize-range", ("/detokenize", {"tokens": [1, -4]}), 400, "out of range", "tokens"),
    ("tokenize-nothing", ("/tokenize", {"model": "tiny"}), 400, "exactly one of", None),
]


def _post(server, path, body, headers=None):
    content = body if isinstance(body, str) else json.dumps(body)
    h = {"content-type": "application/json", **server.headers, **(headers or {})}
    return httpx.post(server.url + path, content=content, headers=h, timeout=30)


def _check_error(r: httpx.Response, status: int, needle: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"] and isinstance(err["type"], str)
    if needle:
        assert needle in err["message"], err["message"]
    if param:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("path_body,status,needle,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(server, path_body, status, needle, param):
    path, body = path_body
    _check_error(_post(server, path, body), status, needle, param)


def test_auth(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        _check_error(r, 401, "API key")
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # probes stay open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_routes_and_body_limit(server):
    _check_error(httpx.get(server.url + "/v1/nothing", headers=server.headers), 404, "no route")
    _check_error(httpx.get(server.url + "/v1/completions", headers=server.headers), 405)
    big = json.dumps({"model": "tiny", "prompt": "x" * 70000})
    _check_error(_post(server, "/v1/completions", big), 413, "exceeds the limit of 65536 bytes")

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(20):
            yield b" " * 4096
        yield b'{"prompt": "x"}'

    r = httpx.post(
        server.url + "/v1/completions",
        content=chunks(),
        headers={**server.headers, "content-type": "application/json"},
    )
    _check_error(r, 413, "exceeds the limit")


def test_openai_client_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
        client.completions.create(model="tiny", prompt="z" * 1000, max_tokens=500)
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.chat.completions.create(model="other", messages=MSG)
    with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
        client.chat.completions.create(model="tiny", messages=[], stream=True)


def test_queue_full_then_recovers(server):
    client = server.client()
    # n=2 fills both sequence slots (max_num_seqs 2 + max_queue 0) for ~1000 decode steps.
    stream = client.completions.create(
        model="tiny", prompt="x", n=2, max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    next(it)
    r = _post(server, *_cmpl())
    err = _check_error(r, 429, "queue is full")
    assert err["type"] == "rate_limit_error" and r.headers.get("retry-after") == "1"
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2)
    stream.close()  # the disconnect aborts both sequences and frees their slots
    import time

    deadline = time.monotonic() + 5
    while True:
        r = _post(server, *_cmpl())
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    m = server.metrics()
    assert m['openinfer:request_rejected_total{reason="queue_full"}'] >= 2


def test_serves_normally_after_errors(server):
    client = server.client()
    r = client.completions.create(
        model="tiny", prompt="still fine", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    c = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3, stream=True)
    assert sum(1 for ch in c if ch.choices) >= 1
    assert httpx.get(server.url + "/health/ready").status_code == 200
    m = server.metrics()
    assert m["openinfer:num_requests_running"] == 0
    assert m["openinfer:kv_cache_free_blocks"] == m["openinfer:kv_cache_total_blocks"]
    assert server.alive
