"""`openinfer serve` against the offline API: same tokens for the same seed, usage, logprobs, n, echo, stop
strings, models / tokenize / detokenize / reset_prefix_cache, health and metric names.

One real server process (tiny random Llama, fp32) for the module, driven with the official ``openai`` client
and httpx.
"""

from __future__ import annotations

import httpx
import pytest
from server_utils import ServerProcess, shared_checkpoint

from openinfer import LLM, SamplingParams

ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--num-kv-blocks",
    "512",
    "--served-model-name",
    "tiny",
    "alias",
]
PROMPTS = ["The quick brown fox", "hello world, this is", "a"]
CASES = [dict(temperature=0.0), dict(temperature=0.8, seed=1234, top_k=50)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return shared_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def booting(ckpt):
    with ServerProcess(ckpt, *ARGS, wait=False) as s:
        yield s


@pytest.fixture(scope="module")
def llm(ckpt, booting):
    # Built while the server process boots.
    return LLM(str(ckpt), dtype="float32", max_model_len=256, num_kv_blocks=512)


@pytest.fixture(scope="module")
def server(booting, llm):
    return booting.wait_ready()


def _extra(case: dict) -> tuple[dict, dict]:
    """Split a case into OpenAI kwargs and extra_body."""
    kw = {k: v for k, v in case.items() if k in ("temperature", "seed")}
    extra = {k: v for k, v in case.items() if k not in kw}
    return kw, {**extra, "ignore_eos": True, "return_token_ids": True}


def _collect_stream(stream, chat: bool = False):
    text, ids, usage, finish = "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += (c.delta.content or "") if chat else c.text
            ids += c.model_extra.get("token_ids") or []
            finish = c.finish_reason or finish
    return text, ids, usage, finish


@pytest.mark.parametrize("case", CASES, ids=["greedy", "seeded"])
def test_completions_match_offline(server, llm, case):
    offline = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True, **case), use_tqdm=False)
    client = server.client()
    kw, extra = _extra(case)
    for prompt, off in zip(PROMPTS, offline):
        want = off.outputs[0]
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, extra_body=extra, **kw)
        assert r.choices[0].text == want.text
        assert r.choices[0].model_extra["token_ids"] == want.token_ids
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(off.prompt_token_ids) and r.usage.completion_tokens == 12
        stream = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            extra_body=extra,
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
        text, ids, usage, finish = _collect_stream(stream)
        assert (text, ids, finish) == (want.text, want.token_ids, "length")
        assert usage.prompt_tokens == len(off.prompt_token_ids) and usage.completion_tokens == 12
        assert usage.total_tokens == usage.prompt_tokens + 12


@pytest.mark.parametrize("case", CASES, ids=["greedy", "seeded"])
def test_chat_matches_offline(server, llm, case):
    convs = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    convs.append([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    offline = llm.chat(convs, SamplingParams(max_tokens=10, ignore_eos=True, **case), use_tqdm=False)
    client = server.client()
    kw, extra = _extra(case)
    for conv, off in zip(convs, offline):
        want = off.outputs[0]
        r = client.chat.completions.create(
            model="alias", messages=conv, max_completion_tokens=10, extra_body=extra, **kw
        )
        assert r.choices[0].message.content == want.text
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].model_extra["token_ids"] == want.token_ids
        assert r.model_extra["prompt_token_ids"] == off.prompt_token_ids
        assert r.usage.prompt_tokens == len(off.prompt_token_ids) and r.usage.completion_tokens == 10
        stream = client.chat.completions.create(
            model="alias",
            messages=conv,
            max_tokens=10,
            extra_body=extra,
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
        text, ids, usage, finish = _collect_stream(stream, chat=True)
        assert (text, ids, finish) == (want.text, want.token_ids, "length")
        assert usage.completion_tokens == 10 and usage.prompt_tokens == len(off.prompt_token_ids)


def test_usage_chunk_and_cached_tokens(server):
    client = server.client()
    prompt = "cached-prefix test: " + "abcdefghij" * 5  # 70 characters = 70 tokens (char-level tokenizer)
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
    assert first.usage.prompt_tokens == 70
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Same prompt again: every full block but the one holding the last token comes from the prefix cache.
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
    assert second.usage.prompt_tokens_details.cached_tokens == (70 - 1) // 16 * 16
    # Streaming: usage only on the final chunk (choices empty), null on the others; raw SSE ends with [DONE].
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    import json

    chunks = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"]["prompt_tokens"] == 70 and last["usage"]["completion_tokens"] == 4
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    # continuous_usage_stats: running usage on every chunk.
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    seen = [c.usage.completion_tokens for c in stream if c.choices]
    assert seen == [1, 2, 3, 4, 5]


def test_n_logprobs_echo_multi_prompt(server, llm):
    client = server.client()
    # n > 1 with a seed: the samples match the offline n > 1 samples (seed, seed + 1, ...).
    off = llm.generate(
        "n test", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0]
    r = client.completions.create(
        model="tiny",
        prompt="n test",
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in off.outputs]
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == 6
    # completions logprobs: sampled token's logprob matches the offline one; top entries 3 (+ sampled).
    off = llm.generate(
        "logprob", SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    r = client.completions.create(model="tiny", prompt="logprob", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs == pytest.approx([d[t] for d, t in zip(off.logprobs, off.token_ids)], abs=1e-4)
    assert all(3 <= len(t) <= 4 for t in lp.top_logprobs)
    assert lp.text_offset == [0, 1, 2, 3] or lp.text_offset[0] == 0
    # echo + logprobs: the prompt comes back first, its first token without a logprob.
    r = client.completions.create(
        model="tiny", prompt="echo me", max_tokens=2, temperature=0, echo=True, logprobs=1
    )
    c = r.choices[0]
    assert c.text.startswith("echo me") and len(c.logprobs.tokens) == 7 + 2
    assert c.logprobs.token_logprobs[0] is None and all(x is not None for x in c.logprobs.token_logprobs[1:])
    stream = client.completions.create(
        model="tiny", prompt="echo me", max_tokens=2, temperature=0, echo=True, stream=True
    )
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == c.text
    # chat logprobs / top_logprobs.
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "lp"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    # several prompts in one completion request: choices indexed prompt-major, usage summed.
    r = client.completions.create(model="tiny", prompt=["ab", "cde"], n=2, max_tokens=2, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8
    # token-id prompts work like text prompts.
    ids = llm.get_tokenizer().encode("The quick brown fox")
    a = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    b = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=5, temperature=0)
    assert a.choices[0].text == b.choices[0].text


def test_stop_strings_match_offline(server, llm):
    base = (
        llm.generate(
            "stop here", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    stop = base[6:8]
    assert stop and stop in base
    want = llm.generate(
        "stop here",
        SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    client = server.client()
    r = client.completions.create(
        model="tiny",
        prompt="stop here",
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == want.text and stop not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop
    stream = client.completions.create(
        model="tiny",
        prompt="stop here",
        max_tokens=24,
        temperature=0,
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text, _, _, finish = _collect_stream(stream)
    assert text == want.text and finish == "stop"


def test_models_tokenize_detokenize_reset(server, llm):
    client = server.client()
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "alias"]
    assert models[0].model_extra["max_model_len"] == 256
    tok = llm.get_tokenizer()
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hello there"}).json()
    assert (
        r["tokens"] == tok.encode("hello there")
        and r["count"] == len(r["tokens"])
        and r["max_model_len"] == 256
    )
    r2 = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert r2["prompt"] == "hello there"
    msgs = [{"role": "user", "content": "hi"}]
    r3 = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()
    from openinfer.tokenizer import apply_chat_template

    assert r3["tokens"] == apply_chat_template(tok, msgs, True)
    prompt = "reset-prefix-cache check " * 3
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    hit = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert hit.usage.prompt_tokens_details.cached_tokens > 0
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200
    miss = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert miss.usage.prompt_tokens_details.cached_tokens == 0


def test_health_and_metric_names(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    for method in ("GET", "POST"):  # vLLM's / SageMaker's liveness route
        r = httpx.request(method, server.url + "/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    ready = httpx.get(server.url + "/health/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    server.client().completions.create(model="tiny", prompt="metrics", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "kv_cache_free_blocks",
        "kv_cache_total_blocks",
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        'request_success_total{finished_reason="length"',
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
    ):
        assert f"openinfer:{name}" in text, name
    m = server.metrics()
    assert m["openinfer:kv_cache_total_blocks"] == 512


def test_responses_fit_the_documented_schemas(server):
    from openinfer.server.protocol import ChatCompletionResponse, CompletionResponse, ModelList

    body = {"model": "tiny", "prompt": "schema", "max_tokens": 3, "logprobs": 2, "return_token_ids": True}
    r = CompletionResponse.model_validate(httpx.post(server.url + "/v1/completions", json=body).json())
    assert r.choices[0].logprobs is not None and len(r.choices[0].token_ids) == 3
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 1,
    }
    c = ChatCompletionResponse.model_validate(
        httpx.post(server.url + "/v1/chat/completions", json=body).json()
    )
    assert len(c.choices[0].logprobs.content) == 2 and c.usage.total_tokens == c.usage.prompt_tokens + 2
    assert ModelList.model_validate(httpx.get(server.url + "/v1/models").json()).data[0].id == "tiny"
