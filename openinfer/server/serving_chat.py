"""POST /v1/chat/completions, streaming and not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from openinfer.server.errors import APIError
from openinfer.server.messages import AddRequest, RequestUpdate
from openinfer.server.protocol import ChatCompletionRequest, ChatMessage
from openinfer.sampling_params import SamplingParams
from openinfer.tokenizer import PromptTooLong
from openinfer.server.chat_tools import ChoiceParser, ToolPlan, check_tools
from openinfer.server.structured import compile_or_400, from_body
from openinfer.server.serving import (
    DONE,
    MAX_LOGPROBS,
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

_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise APIError("messages must be a non-empty list", 400, "messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise APIError(
                f"messages[{i}].role must be one of {sorted(_ROLES)}, got {m.role!r}",
                400,
                f"messages.{i}.role",
            )
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                        400,
                        f"messages.{i}.content",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        d: dict[str, Any] = {**(m.model_extra or {}), "role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


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
    """A checked chat request, ready to admit: its tools plan, prompt ids and sampling params."""

    plan: ToolPlan | None
    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    params: SamplingParams


async def create_chat_completion(ctx: ServingContext, request: Request, body: bytes) -> Response:
    arrival_s = time.monotonic()
    req = await ctx.parse_request(ChatCompletionRequest, body)
    model = ctx.check_model(req.model)
    prep = await prepare_chat(ctx, req)
    plan, messages, ids, params = prep.plan, prep.messages, prep.prompt_ids, prep.params
    rid = ctx.new_id("chatcmpl")
    echo = ""
    if req.echo and messages[-1]["role"] == "assistant":
        echo = messages[-1]["content"] or ""
    stream, buffered = await ctx.start([AddRequest(rid, ids, params, None, arrival_s)])
    created = int(time.time())
    top_n = req.top_logprobs or 0
    parsers = {i: ChoiceParser(ctx.tool_parser, plan, ctx.settings.reasoning_parser) for i in range(req.n)}
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


async def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest) -> PreparedChat:
    """Everything between parsing and admission, shared by /v1/chat/completions and /v1/messages: every client
    mistake is a 400 here, before the engine sees the request."""
    ctx.check_common(req)
    plan = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls, ctx.tool_parser)
    constraint = from_body(req.structured_outputs, req.response_format)
    if plan is not None and plan.constraint is not None:
        if constraint is not None:
            raise APIError(
                "tool_choice 'required' or a named function cannot be combined with a response format",
                400,
                "tool_choice",
            )
        constraint = plan.constraint
        await compile_or_400(ctx.engine.grammar_compiler, constraint, "tools")
    else:
        await compile_or_400(
            ctx.engine.grammar_compiler,
            constraint,
            "structured_outputs" if req.structured_outputs is not None else "response_format",
        )
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError("top_logprobs requires logprobs=true", 400, "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", 400, "top_logprobs"
            )
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(
            "continue_final_message and add_generation_prompt cannot both be true",
            400,
            "continue_final_message",
        )
    messages = messages_to_dicts(req.messages)
    # The template copies every message's text into the prompt: too many characters cannot fit the context,
    # and are refused before the template and the tokenizer spend time on them.
    ctx.check_prompt_chars(sum(len(m["content"]) if isinstance(m["content"], str) else 0 for m in messages),
                           "messages")
    template_kwargs = dict(req.chat_template_kwargs or {})
    if plan is not None:
        template_kwargs.setdefault("tools", plan.tools)
    try:
        ids = await ctx.tokenizers.apply_chat_template(
            messages,
            req.add_generation_prompt,
            ctx.max_prompt_chars,  # tools and template kwargs count too: refused before tokenizing
            continue_final_message=req.continue_final_message,
            **template_kwargs,
        )
    except APIError:
        raise
    except PromptTooLong as e:
        ctx.check_prompt_chars(e.num_chars, "messages")
        raise
    except Exception as e:  # template errors are the client's messages meeting the template
        raise APIError(f"cannot apply the chat template: {e}", 400, "messages") from None
    ctx.check_prompt_ids(ids, "messages")
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = ctx.resolve_max_tokens(requested, len(ids), param, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = ctx.sampling_params(req, max_tokens, logprobs, req.prompt_logprobs, constraint)
    return PreparedChat(plan, messages, ids, params)


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
