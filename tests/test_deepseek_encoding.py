"""DeepSeek-V4 chat encoding: byte-identical to the release's reference rendering on its official fixtures and
on ours (multi-turn, system, tools, tool results, thinking on / off, reasoning effort), and reachable through
--tokenizer-mode deepseek_v4 (offline chat and the server)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from openinfer.chat_encoding import deepseek_v32
from openinfer.chat_encoding.deepseek_v4 import encode_messages
from openinfer.tokenizer import apply_chat_template, load_tokenizer

FIXTURES = Path(__file__).parent / "data" / "deepseek_v4_encoding"
CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))
FIXTURES_V32 = Path(__file__).parent / "data" / "deepseek_v32_encoding"


@pytest.mark.parametrize("name", CASES)
def test_byte_identical_to_the_reference(name):
    case = json.loads((FIXTURES / f"{name}.json").read_text())
    assert encode_messages(case["messages"], **case["kwargs"]) == (FIXTURES / f"{name}.txt").read_text(
        encoding="utf-8")


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES_V32.glob("*.json")))
def test_v32_byte_identical_to_the_reference(name):
    case = json.loads((FIXTURES_V32 / f"{name}.json").read_text())
    assert deepseek_v32.encode_messages(case["messages"], **case["kwargs"]) == (
        FIXTURES_V32 / f"{name}.txt").read_text(encoding="utf-8")


def test_fixtures_cover_what_the_issue_asks():
    assert len(CASES) >= 14
    texts = {n: (FIXTURES / f"{n}.txt").read_text() for n in CASES}
    assert any("<｜DSML｜tool_calls>" in t and "<tool_result>" in t for t in texts.values())  # tools + results
    assert any(t.endswith("<｜Assistant｜><think>") for t in texts.values())  # thinking on
    assert any(t.endswith("<｜Assistant｜></think>") for t in texts.values())  # thinking off


@pytest.mark.parametrize("kw, words", [(dict(thinking_mode="deep"), "thinking_mode"),
                                       (dict(reasoning_effort="low"), "reasoning_effort")])
def test_bad_settings_name_the_field(kw, words):
    with pytest.raises(ValueError, match=words):
        encode_messages([{"role": "user", "content": "x"}], **kw)


def test_tokenizer_mode_renders_with_the_encoder(tmp_path):
    from openinfer.utils.char_tokenizer import write_char_tokenizer

    write_char_tokenizer(tmp_path, 256)
    tok = load_tokenizer(str(tmp_path))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    ids = apply_chat_template(tok, msgs, True, tokenizer_mode="deepseek_v4", tools=tools, thinking=True)
    want = encode_messages([{**msgs[0], "tools": tools}, msgs[1]], thinking_mode="thinking")
    assert ids == tok.encode(want, add_special_tokens=False)
    ids = apply_chat_template(tok, msgs[1:], True, tokenizer_mode="deepseek_v4", tools=tools)
    assert ids == tok.encode(encode_messages([{"role": "system", "content": "", "tools": tools}, msgs[1]]),
                             add_special_tokens=False)


def test_the_server_uses_the_encoder(tmp_path):
    """--tokenizer-mode deepseek_v4: /tokenize of messages with tools is the encoder's prompt."""
    import httpx

    from helpers import make_dense_checkpoint
    from server_utils import InProcessServer

    ckpt = make_dense_checkpoint(tmp_path / "m", "llama", max_position_embeddings=2048)
    msgs = [{"role": "user", "content": "hi"}]
    with InProcessServer(ckpt, dtype="float32", max_model_len=2048, num_kv_blocks=256,
                         tokenizer_mode="deepseek_v4") as s:
        r = httpx.post(s.url + "/tokenize", json={"messages": msgs}, timeout=60)
        assert r.status_code == 200, r.text
        tok = s.engine.tokenizer
        assert r.json()["tokens"] == tok.encode(encode_messages(msgs), add_special_tokens=False)
        r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "messages": msgs, "max_tokens": 2, "chat_template_kwargs": {"thinking": True}, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["prompt_token_ids"] == tok.encode(encode_messages(msgs, thinking_mode="thinking"),
                                                          add_special_tokens=False)


def test_tokenizer_mode_deepseek_v32(tmp_path):
    from openinfer.utils.char_tokenizer import write_char_tokenizer

    write_char_tokenizer(tmp_path, 256)
    tok = load_tokenizer(str(tmp_path))
    msgs = [{"role": "user", "content": "hi"}]
    ids = apply_chat_template(tok, msgs, True, tokenizer_mode="deepseek_v32", thinking=True)
    assert ids == tok.encode(deepseek_v32.encode_messages(msgs, thinking_mode="thinking"), add_special_tokens=False)
