"""Anthropic's Messages API (/v1/messages) mapped onto the chat request it means, which the one validator
(request_validation.py) then checks as any chat request: system and content blocks (text, image, tool_use,
tool_result, thinking) -> OpenAI chat messages, tools' ``input_schema`` -> ``parameters``, tool_choice, stop_sequences.
A body that cannot be mapped is an ``APIError`` (400) naming the field, rendered in Anthropic's error shape."""
from __future__ import annotations

import json
import uuid
from typing import Any

from openinfer.server.errors import APIError
from openinfer.server.protocol import ChatCompletionRequest

_ANTHROPIC_SAMPLING = ("temperature", "top_p", "top_k")

def _fail(message: str, param: str) -> APIError:
    return APIError(message, 400, param)


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(f"{where} must be a string or a list of content blocks", where)
    parts = []
    for i, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise _fail(f"{where}.{i}: only text blocks are supported here", f"{where}.{i}")
        parts.append(b["text"])
    return "\n".join(parts)


def _anthropic_image_url(source: Any, at: str) -> str:
    """An image block's ``source`` as the URL an OpenAI image_url part carries: base64 data -> a data: URL; a
    url source as given (image_io reads only data: and permitted file:// URLs)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not media.startswith("image/") or not isinstance(data, str):
            raise _fail(f"{at}.source: a base64 image needs media_type image/... and data (a string)", f"{at}.source")
        return f"data:{media};base64,{data}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise _fail(f"{at}.source.type must be 'base64' or 'url', got {kind!r}", f"{at}.source.type")


def anthropic_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    """system + messages (text, tool_use, tool_result, thinking blocks) as OpenAI chat messages."""
    if not isinstance(messages, list) or not messages:
        raise _fail("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _fail(f"{where}.role must be 'user' or 'assistant'", f"{where}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise _fail(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
        texts, calls, parts = [], [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            at = f"{where}.content.{j}"
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
                parts.append({"type": "text", "text": b["text"]})
            elif kind == "image" and m["role"] == "user":
                parts.append({"type": "image_url", "image_url": {"url": _anthropic_image_url(b.get("source"), at)}})
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise _fail(f"{at}: tool_use needs a name and an input object", at)
                calls.append({"id": b.get("id") or f"toolu_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result" and m["role"] == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise _fail(f"{at}: tool_result needs tool_use_id", at)
                result = b.get("content", "")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": _text_of(result, f"{at}.content") if result else ""})
            elif kind == "thinking" and m["role"] == "assistant":
                continue  # earlier turns' thinking is not sent back to the model (as DeepSeek's encoders do)
            else:
                raise _fail(f"{at}: unsupported content block {kind!r} for role {m['role']!r}", at)
        if len(parts) > len(texts):  # images among the blocks: OpenAI content parts, in block order
            out.append({"role": m["role"], "content": parts})
        elif texts or calls or not content:
            msg: dict[str, Any] = {"role": m["role"], "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def anthropic_to_chat(body: Any, count_only: bool = False) -> ChatCompletionRequest:
    """A /v1/messages body as the chat request it means: system and content blocks -> messages, tools'
    ``input_schema`` -> ``parameters``, tool_choice auto / any / tool / none -> auto / required / named / none,
    stop_sequences -> stop. ``count_only`` (count_tokens): max_tokens is not required, and not used."""
    if not isinstance(body, dict):
        raise _fail("the body must be a JSON object", "body")
    if not count_only and (not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool)):
        raise _fail("max_tokens is required (an integer)", "max_tokens")
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": anthropic_messages(body.get("system"), body.get("messages")),
        "max_tokens": None if count_only else body["max_tokens"],
        "stream": bool(body.get("stream", False)),
    }
    for k in _ANTHROPIC_SAMPLING:
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _fail("tools must be a list", "tools")
        chat["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise _fail(f"tools.{i} must be an object with a name", f"tools.{i}.name")
            fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            chat["tools"].append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind in ("auto", "none"):
            chat["tool_choice"] = kind
        elif kind == "any":
            chat["tool_choice"] = "required"
        elif kind == "tool" and isinstance(choice.get("name"), str):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise _fail("tool_choice must be {type: auto | any | none} or {type: tool, name}", "tool_choice")
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    try:
        return ChatCompletionRequest.model_validate(chat)
    except Exception as e:  # a wrong type in a mapped field: still the client's input
        raise _fail(f"invalid request: {e}", "body") from None
