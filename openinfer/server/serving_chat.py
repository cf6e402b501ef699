"""POST /v1/chat/completions, streaming and not."""

from __future__ import annotations

import asyncio

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from openinfer.server.messages import AddRequest, RequestUpdate
from openinfer.server.protocol import ChatCompletionRequest
from openinfer.server.chat_tools import ChoiceParser, ToolPlan
from openinfer.server.request_validation import CheckedChat
from openinfer.server.serving import (
    DONE,
    ClientDisconnected,
    EngineStreamingResponse,
    ServingContext,
    UsageTracker,
    cancel_on_disconnect,
    ended_error,
    finish_error,
    update_error,
    update_failed,
    json_bytes,
    sse,
    stream_flags,
    update_batches,
    updates,
)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def _chat_logprobs(
    ctx: ServingContext, ids: list[int], lps: list[dict[int, float]], top_n: int
) -> list:
    tops = [sorted(lp.items(), key=lambda kv: -kv[1])[:top_n] for lp in lps]
    strs = await ctx.tokenizers.token_strs(ids + [t for top in tops for t, _ in top])
    names = iter(strs[len(ids) :])
    content = []
    for tok_id, tok, lp, top in zip(ids, strs[: len(ids)], lps, tops):
        entries = []
        for _, v in top:
            name = next(names)
            entries.append({"token": name, "logprob": v, "bytes": list(name.encode("utf-8"))})
        content.append(
            {
                "token": tok,
                "logprob": lp.get(tok_id),
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": entries,
            }
        )
    return content


@dataclass
class PreparedChat:
    """A checked chat request, ready to admit: its tools plan, messages and the engine request."""

    model: str
    plan: ToolPlan | None
    messages: list[dict[str, Any]]
    add: AddRequest
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_ids(self) -> list[int]:
        return self.add.prompt_token_ids


async def create_chat_completion(ctx: ServingContext, request: Request, body: bytes) -> Response:
    arrival_s = time.monotonic()
    req = await ctx.parse_request(ChatCompletionRequest, body)
    rid = ctx.new_id("chatcmpl")
    prep = await prepare_chat(ctx, await ctx.validator.check_chat(req), rid, arrival_s)
    model, plan, messages, ids = prep.model, prep.plan, prep.messages, prep.prompt_ids
    echo = ""
    if req.echo and messages[-1]["role"] == "assistant":
        echo = messages[-1]["content"] or ""
    stream, buffered = await ctx.start([prep.add])
    created = int(time.time())
    top_n = req.top_logprobs or 0
    parsers = {i: ChoiceParser(ctx.tool_parser, plan, ctx.settings.reasoning_parser, prep.template_kwargs)
               for i in range(req.n)}
    if req.stream:
        return EngineStreamingResponse(
            _stream(ctx, req, model, rid, created, ids, echo, top_n, stream, buffered, parsers), stream
        )
    try:
        result = await cancel_on_disconnect(
            request,
            _collect(ctx, req, model, rid, created, ids, echo, top_n, stream, buffered, parsers),
            stream,
        )
    except ClientDisconnected:
        return Response(status_code=499)
    return Response(json_bytes(result), media_type="application/json")


async def prepare_chat(ctx: ServingContext, checked: CheckedChat, request_id: str,
                       arrival_s: float | None = None) -> PreparedChat:
    """A chat request checked by the validator (``check_chat``, or ``check_messages`` for /v1/messages) through
    the chat template, and its engine request: every client mistake is a 400 by here, before the engine sees it."""
    ids = await ctx.render_chat(checked.messages, checked.request.add_generation_prompt,
                                checked.request.continue_final_message, checked.template_kwargs)
    mm_images = []
    if checked.images:
        ids, mm_images = await asyncio.to_thread(ctx.validator.images.place, ids, checked.images)  # resizes: CPU
    add = ctx.validator.engine_request(checked, request_id, ids, None, arrival_s, mm_images)
    return PreparedChat(checked.model, checked.plan, checked.messages, add, checked.template_kwargs)


async def _collect(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    model: str,
    rid: str,
    created: int,
    prompt_ids: list[int],
    echo: str,
    top_n: int,
    stream,
    buffered,
    parsers: dict[int, ChoiceParser],
) -> dict:
    usage = UsageTracker()
    choices: dict[int, _Choice] = {}
    async for u in updates(stream, buffered):
        usage.add(u)
        if u.error:
            raise ended_error(u)
        for d in u.outputs:
            c = choices.setdefault(d.index, _Choice())
            c.text.append(d.text)
            c.token_ids.extend(d.token_ids)
            if d.logprobs:
                c.logprobs.extend(d.logprobs)
            if d.finish_reason is not None:
                c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
    failed = next((c for c in choices.values() if c.finish_reason == "error"), None)
    if failed is not None:
        raise finish_error(failed.stop_reason)
    out = []
    for i in range(req.n):
        c = choices.get(i, _Choice(finish_reason="abort"))
        logprobs = None
        if req.logprobs:
            logprobs = {"content": await _chat_logprobs(ctx, c.token_ids, c.logprobs, top_n)}
        message: dict[str, Any] = {"role": "assistant", "content": echo + "".join(c.text)}
        finish_reason = c.finish_reason
        parser = parsers[i]
        if parser.active:
            parsed = parser.feed("".join(c.text))
            rest = parser.finish()
            content = parsed.content + rest.content
            tool_calls = parsed.tool_calls + rest.tool_calls
            message["content"] = echo + content if (content or not tool_calls) else None
            if parser.reasoning is not None:
                message["reasoning_content"] = (parsed.reasoning + rest.reasoning) or None
            if tool_calls:
                message["tool_calls"] = tool_calls
                if finish_reason == "stop":
                    finish_reason = "tool_calls"
        choice = {
            "index": i,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": c.stop_reason,
        }
        if req.return_token_ids:
            choice["token_ids"] = c.token_ids
        out.append(choice)
    resp = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage.usage(),
        **usage.response_extras(),
    }
    if req.return_token_ids:
        resp["prompt_token_ids"] = prompt_ids
    return resp


async def _stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    model: str,
    rid: str,
    created: int,
    prompt_ids: list[int],
    echo: str,
    top_n: int,
    stream,
    buffered: list[RequestUpdate],
    parsers: dict[int, ChoiceParser],
) -> AsyncIterator[bytes]:
    include_usage, continuous = stream_flags(req.stream_options)
    usage = UsageTracker()
    started: set[int] = set()
    failed = False
    async for batch in update_batches(stream, buffered):
        out: list[bytes] = []
        for u in batch:
            usage.add(u)
            if update_failed(u):
                out.append(sse(update_error(u).body()))
                failed = True
                break
            for d in u.outputs:
                delta: dict[str, Any] = {}
                text, finish_reason = d.text, d.finish_reason
                parser = parsers[d.index]
                if parser.active:
                    parsed = parser.feed(d.text)
                    if d.finish_reason is not None:
                        rest = parser.finish()
                        parsed.content += rest.content
                        parsed.reasoning += rest.reasoning
                        parsed.tool_calls += rest.tool_calls
                    text = parsed.content
                    if parsed.reasoning:
                        delta["reasoning_content"] = parsed.reasoning
                    if parsed.tool_calls:
                        delta["tool_calls"] = parsed.tool_calls
                    if finish_reason == "stop" and parser.num_calls:
                        finish_reason = "tool_calls"
                if d.index not in started:
                    started.add(d.index)
                    delta["role"] = "assistant"
                    delta["content"] = echo + text
                elif text or not parser.active:
                    delta["content"] = text
                choice: dict[str, Any] = {
                    "index": d.index,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": d.stop_reason,
                }
                if req.logprobs and d.logprobs:
                    choice["logprobs"] = {
                        "content": await _chat_logprobs(ctx, d.token_ids, d.logprobs, top_n)
                    }
                if req.return_token_ids:
                    choice["token_ids"] = d.token_ids
                chunk = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                }
                if include_usage:
                    chunk["usage"] = usage.usage() if continuous else None
                out.append(sse(chunk))
        if out:
            yield b"".join(out)
        if failed:
            stream.abort()
            break
    final = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage.usage(),
    }
    yield (sse(final) if include_usage else b"") + DONE
