"""Anthropic's Messages API: POST /v1/messages (+ /v1/messages/count_tokens), mapped onto the chat path.

The request becomes a chat completion request (system, text, tool_use / tool_result blocks -> OpenAI messages;
tools' ``input_schema`` -> ``parameters``; tool_choice auto / any / tool / none -> auto / required / named /
none: ``anthropic_request.anthropic_to_chat``), checked by the same validator and tokenized by the same
``prepare_chat``; the output goes through the same reasoning and tool-call parsers and comes back as content
blocks (thinking, text, tool_use) - streamed as Anthropic's SSE events (message_start, content_block_start /
_delta / _stop, message_delta, message_stop)."""

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


async def _parse_body(ctx: ServingContext, body: bytes) -> Any:
    try:
        return await decode_json(body or b"null", lambda top: precheck(ctx.validator, top, anthropic=True))
    except msgspec.DecodeError as e:
        raise APIError(f"the body is not valid JSON ({e})", 400, "body") from None


async def count_tokens(ctx: ServingContext, body: bytes) -> Response:
    checked = await ctx.validator.check_messages(await _parse_body(ctx, body), count_only=True)
    prep = await prepare_chat(ctx, checked, "count_tokens")
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
    checked = await ctx.validator.check_messages(await _parse_body(ctx, body))
    req, model = checked.request, checked.model
    rid = "msg_" + uuid.uuid4().hex[:24]
    prep = await prepare_chat(ctx, checked, rid, arrival_s)
    stream, buffered = await ctx.start([prep.add])
    parser = ChoiceParser(ctx.tool_parser, prep.plan, ctx.settings.reasoning_parser, prep.template_kwargs)
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
