"""Anthropic's Messages API: POST /v1/messages (+ /v1/messages/count_tokens), mapped onto the chat path.

The request becomes a chat completion request (system, text, tool_use / tool_result blocks -> OpenAI messages;
tools' ``input_schema`` -> ``parameters``; tool_choice auto / any / tool / none -> auto / required / named /
none), checked and tokenized by the same ``prepare_chat``; the output goes through the same reasoning and
tool-call parsers and comes back as content blocks (thinking, text, tool_use) - streamed as Anthropic's SSE
events (message_start, content_block_start / _delta / _stop, message_delta, message_stop)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from openinfer.server.body_precheck import precheck
from openinfer.server.chat_tools import ChoiceDelta, ChoiceParser
from openinfer.server.errors import APIError
from openinfer.server.messages import AddRequest
from openinfer.server.protocol import ChatCompletionRequest
from openinfer.server.request_parsing import decode_json
from openinfer.server.serving import (
    ClientDisconnected,
    EngineStreamingResponse,
    ServingContext,
    UsageTracker,
    cancel_on_disconnect,
    update_error,
    update_batches,
    update_failed,
    updates,
)
from openinfer.server.serving_chat import prepare_chat

_SAMPLING = ("temperature", "top_p", "top_k")


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


def to_chat_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
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
        texts, calls = [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            at = f"{where}.content.{j}"
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
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
        if texts or calls or not content:
            msg: dict[str, Any] = {"role": m["role"], "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def to_chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    if not isinstance(body, dict):
        raise _fail("the body must be a JSON object", "body")
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise _fail("max_tokens is required (an integer)", "max_tokens")
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": to_chat_messages(body.get("system"), body.get("messages")),
        "max_tokens": body["max_tokens"],
        "stream": bool(body.get("stream", False)),
    }
    for k in _SAMPLING:
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


async def _parse_body(ctx: ServingContext, body: bytes) -> dict[str, Any]:
    try:
        return await decode_json(body or b"null", lambda top: precheck(ctx, top, anthropic=True))
    except msgspec.DecodeError as e:
        raise _fail(f"the body is not valid JSON ({e})", "body") from None


async def count_tokens(ctx: ServingContext, body: bytes) -> Response:
    raw = await _parse_body(ctx, body)
    if isinstance(raw, dict):
        raw = {**raw, "max_tokens": 1}
    req = to_chat_request(raw)
    ctx.check_model(req.model)
    prep = await prepare_chat(ctx, req.model_copy(update={"max_tokens": None}))
    return Response(msgspec.json.encode({"input_tokens": len(prep.prompt_ids)}), media_type="application/json")


def _stop_reason(finish: str | None, stop: int | str | None, tool_use: bool) -> tuple[str | None, str | None]:
    if tool_use and finish == "stop":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return ("end_turn" if finish == "stop" else finish), None


def _tool_block(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


async def create_message(ctx: ServingContext, request: Request, body: bytes) -> Response:
    arrival_s = time.monotonic()
    req = to_chat_request(await _parse_body(ctx, body))
    model = ctx.check_model(req.model)
    prep = await prepare_chat(ctx, req)
    rid = "msg_" + uuid.uuid4().hex[:24]
    stream, buffered = await ctx.start([AddRequest(rid, prep.prompt_ids, prep.params, None, arrival_s)])
    parser = ChoiceParser(ctx.tool_parser, prep.plan, ctx.settings.reasoning_parser)
    if req.stream:
        return EngineStreamingResponse(_stream(model, rid, len(prep.prompt_ids), parser, stream, buffered), stream)
    try:
        result = await cancel_on_disconnect(request, _collect(model, rid, parser, stream, buffered), stream)
    except ClientDisconnected:
        return Response(status_code=499)
    return Response(msgspec.json.encode(result), media_type="application/json")


async def _collect(model: str, rid: str, parser: ChoiceParser, stream, buffered) -> dict:
    usage = UsageTracker()
    text, finish, stop = [], None, None
    async for u in updates(stream, buffered):
        usage.add(u)
        if update_failed(u):
            raise update_error(u)
        for d in u.outputs:
            text.append(d.text)
            if d.finish_reason is not None:
                finish, stop = d.finish_reason, d.stop_reason
    parsed = parser.feed("".join(text))
    rest = parser.finish()
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning + rest.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning + rest.reasoning, "signature": ""})
    if parsed.content + rest.content:
        blocks.append({"type": "text", "text": parsed.content + rest.content})
    calls = parsed.tool_calls + rest.tool_calls
    blocks += [_tool_block(c) for c in calls]
    stop_reason, stop_sequence = _stop_reason(finish, stop, bool(calls))
    u = usage.usage()
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                      "cache_read_input_tokens": u["prompt_tokens_details"]["cached_tokens"]}}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode({"type": kind, **data}) + b"\n\n"


class _Blocks:
    """Anthropic's content-block framing of a stream: one open block at a time, indexes in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def start(self, kind: str, block: dict[str, Any], out: list[bytes]) -> None:
        self.stop(out)
        self.index += 1
        self.open = kind
        out.append(_event("content_block_start", {"index": self.index, "content_block": block}))

    def stop(self, out: list[bytes]) -> None:
        if self.open is not None:
            out.append(_event("content_block_stop", {"index": self.index}))
            self.open = None

    def emit(self, delta: ChoiceDelta, out: list[bytes]) -> None:
        if delta.reasoning:
            if self.open != "thinking":
                self.start("thinking", {"type": "thinking", "thinking": ""}, out)
            out.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "thinking_delta", "thinking": delta.reasoning}}))
        if delta.content:
            if self.open != "text":
                self.start("text", {"type": "text", "text": ""}, out)
            out.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "text_delta", "text": delta.content}}))
        for call in delta.tool_calls:  # released whole by the parser: one block, its input in one delta
            block = _tool_block(call)
            self.start("tool_use", {**block, "input": {}}, out)
            out.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": call["function"]["arguments"]}}))
            self.stop(out)


async def _stream(model: str, rid: str, num_prompt_tokens: int, parser: ChoiceParser, stream,
                  buffered) -> AsyncIterator[bytes]:
    usage = UsageTracker()
    blocks = _Blocks()
    yield _event("message_start", {"message": {
        "id": rid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": num_prompt_tokens, "output_tokens": 0}}})
    finish, stop = None, None
    async for batch in update_batches(stream, buffered):
        out: list[bytes] = []
        for u in batch:
            usage.add(u)
            if update_failed(u):
                err = update_error(u)
                kind = "invalid_request_error" if err.status < 500 else "api_error"
                out.append(_event("error", {"error": {"type": kind, "message": err.message}}))
                yield b"".join(out)
                stream.abort()
                return
            for d in u.outputs:
                blocks.emit(parser.feed(d.text), out)
                if d.finish_reason is not None:
                    blocks.emit(parser.finish(), out)
                    finish, stop = d.finish_reason, d.stop_reason
        if out:
            yield b"".join(out)
    out = []
    blocks.stop(out)
    stop_reason, stop_sequence = _stop_reason(finish, stop, parser.num_calls > 0)
    out.append(_event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                        "usage": {"output_tokens": usage.usage()["completion_tokens"]}}))
    out.append(_event("message_stop", {}))
    yield b"".join(out)
