"""Real ``openinfer serve`` processes started with vLLM serve lines: the issue's line (a dense model, hermes tools,
FCFS) and vLLM's DeepSeek-V4 recipe line on the tiny V4 checkpoint (with --scheduling-policy priority). Each
no-op flag's log line is in the server log, the settings take effect over HTTP, and vLLM's routes answer as vLLM's
do: /ping, /version, /v1/models' details, OpenAI's 400 for a message without content, ``priority`` on requests.
tests/test_vllm_compat.py checks each flag group's parsing in process."""
from __future__ import annotations

import httpx
from server_utils import ServerProcess, shared_checkpoint

NOOP = "accepted for vLLM compatibility, changes nothing here"


def chat(url: str, messages: list, **kw) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def check_vllm_routes(s: ServerProcess, max_model_len: int) -> None:
    for method in ("GET", "POST"):
        assert httpx.request(method, s.url + "/ping", timeout=10).status_code == 200
    assert "version" in httpx.get(s.url + "/version", timeout=10).json()
    card = httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]
    assert (card["id"], card["object"], card["root"], card["max_model_len"]) == ("tiny", "model", "tiny",
                                                                                 max_model_len)
    assert card["parent"] is None and card["owned_by"] == "openinfer"
    perm = card["permission"][0]
    assert perm["object"] == "model_permission" and perm["allow_sampling"] and not perm["allow_fine_tuning"]
    for role in ("user", "system"):  # OpenAI: content is required -> 400 with OpenAI's error object
        r = chat(s.url, [{"role": "user", "content": "hi"}, {"role": role}])
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}
        assert err["param"] == "messages.1.content" and err["type"] == "invalid_request_error"
    tok = httpx.post(s.url + "/tokenize", json={"model": "tiny", "prompt": "hello", "return_token_strs": True},
                     timeout=10).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == max_model_len
    detok = httpx.post(s.url + "/detokenize", json={"model": "tiny", "tokens": tok["tokens"]}, timeout=10).json()
    assert detok == {"prompt": "hello"}


def test_the_issues_serve_line(tmp_path_factory):
    ckpt = shared_checkpoint(tmp_path_factory)
    line = ["--served-model-name", "tiny", "--gpu-memory-utilization", "0.5", "--max-model-len", "512",
            "--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--disable-log-requests", "--dtype", "float32", "--enforce-eager", "--uvicorn-log-level", "warning"]
    with ServerProcess(ckpt, *line) as s:
        log = s.log()
        for flag in ("--trust-remote-code", "--enable-auto-tool-choice", "--disable-log-requests",
                     "--enforce-eager"):
            assert f"{flag}: {NOOP}" in log, log
        check_vllm_routes(s, 512)
        # --gpu-memory-utilization sized the cache (vLLM's meaning: a share of the host's RAM here, capped at what
        # the batch can use): the engine started and reports its cache
        assert "KV cache:" in log
        r = chat(s.url, [{"role": "user", "content": "hi"}], priority=1)  # FCFS: vLLM refuses a priority too
        assert r.status_code == 400 and "needs the priority scheduling policy" in r.json()["error"]["message"]
        assert chat(s.url, [{"role": "user", "content": "hi"}], priority=0).status_code == 200


def test_deepseek_v4_recipe_line(tmp_path_factory):
    """vLLM's DeepSeek-V4 recipe flags on the tiny V4 checkpoint: fp8 KV cache in 256-token blocks, expert
    parallelism (one rank), DeepSeek's own chat encoder, DSML tool calls and the V4 reasoning split."""
    from helpers import load_script

    ckpt = load_script("make_deepseek_v4_checkpoint").make_checkpoint(tmp_path_factory.mktemp("v4") / "tiny",
                                                                       "tiny", seed=0)
    recipe = ["--trust-remote-code", "--kv-cache-dtype", "fp8", "--block-size", "256", "--enable-expert-parallel",
              "--tokenizer-mode", "deepseek_v4", "--tool-call-parser", "deepseek_v4", "--enable-auto-tool-choice",
              "--reasoning-parser", "deepseek_v4"]
    with ServerProcess(ckpt, *recipe, "--served-model-name", "tiny", "--max-model-len", "1024",
                       "--scheduling-policy", "priority") as s:
        log = s.log()
        assert f"--trust-remote-code: {NOOP}" in log and f"--enable-auto-tool-choice: {NOOP}" in log, log
        assert "blocks of 256" in log  # the KV cache line: --block-size took effect
        check_vllm_routes(s, 1024)
        msgs = [{"role": "user", "content": "hi"}]
        thinking = chat(s.url, msgs, chat_template_kwargs={"thinking": True}, priority=-1, return_token_ids=True)
        assert thinking.status_code == 200, thinking.text
        # vLLM's chat /tokenize fields: the same prompt the chat route renders, thinking mode included
        tok = httpx.post(s.url + "/tokenize", json={"model": "tiny", "messages": msgs,
                                                    "chat_template_kwargs": {"thinking": True}}, timeout=10).json()
        plain_tok = httpx.post(s.url + "/tokenize", json={"model": "tiny", "messages": msgs}, timeout=10).json()
        assert tok["tokens"] == thinking.json()["prompt_token_ids"] != plain_tok["tokens"]
        # thinking mode: the prompt ends inside <think>, so the output is reasoning until </think>
        message = thinking.json()["choices"][0]["message"]
        assert message.get("reasoning_content") and not message.get("content")
        plain = chat(s.url, msgs, priority=3)  # chat mode: no reasoning split
        assert plain.status_code == 200 and plain.json()["choices"][0]["message"].get("reasoning_content") is None
