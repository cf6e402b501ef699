"""POST /v1/completions, streaming and not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from openinfer.server.messages import RequestUpdate
from openinfer.server.protocol import CompletionRequest
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
class _Prompt:
    request_id: str
    text: str | None
    ids: list[int]
    base_index: int  # choice index of this prompt's first sample


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def _completion_logprobs(
    ctx: ServingContext, ids: list[int], lps: list[dict[int, float] | None], offset: int
) -> tuple[dict, int]:
    """OpenAI's legacy completions logprobs block; ``lps[i]`` is None for the first prompt token."""
    strs = await ctx.tokenizers.token_strs(ids + [t for lp in lps if lp for t in lp])
    tokens = strs[: len(ids)]
    names = iter(strs[len(ids) :])
    token_logprobs, top, offsets = [], [], []
    for tok_id, tok, lp in zip(ids, tokens, lps):
        offsets.append(offset)
        offset += len(tok)
        if lp is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(lp.get(tok_id))
        top.append({next(names): v for v in lp.values()})
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top,
    }, offset


async def create_completion(ctx: ServingContext, request: Request, body: bytes) -> Response:
    arrival_s = time.monotonic()
    req = await ctx.parse_request(CompletionRequest, body)
    checked = await ctx.validator.check_completion(req)
    model = checked.model
    rid = ctx.new_id("cmpl")
    prompts: list[_Prompt] = []
    adds = []
    for i, p in enumerate(checked.prompts):
        if isinstance(p, str):
            text, ids = p, await ctx.encode_prompt(p, add_special_tokens=req.add_special_tokens)
        else:
            text, ids = None, list(p)
        adds.append(ctx.validator.engine_request(checked, f"{rid}-{i}", ids, text, arrival_s))
        prompts.append(_Prompt(f"{rid}-{i}", text, ids, i * req.n))
    echo_texts: dict[str, str] = {}
    if req.echo:
        for p in prompts:
            echo_texts[p.request_id] = p.text if p.text is not None else await ctx.tokenizers.decode(p.ids)
    stream, buffered = await ctx.start(adds)
    by_id = {p.request_id: p for p in prompts}
    created = int(time.time())
    if req.stream:
        return EngineStreamingResponse(
            _stream(ctx, req, model, rid, created, by_id, echo_texts, stream, buffered), stream
        )
    try:
        result = await cancel_on_disconnect(
            request, _collect(ctx, req, model, rid, created, by_id, echo_texts, stream, buffered), stream
        )
    except ClientDisconnected:
        return Response(status_code=499)
    return Response(json_bytes(result), media_type="application/json")


async def _collect(
    ctx: ServingContext,
    req: CompletionRequest,
    model: str,
    rid: str,
    created: int,
    prompts: dict[str, _Prompt],
    echo_texts: dict[str, str],
    stream,
    buffered,
) -> dict:
    usage = UsageTracker()
    choices: dict[int, _Choice] = {}
    prompt_lps: dict[str, list] = {}
    async for u in updates(stream, buffered):
        usage.add(u)
        if u.prompt_logprobs is not None:
            prompt_lps[u.request_id] = u.prompt_logprobs
        if u.error:
            raise ended_error(u)
        base = prompts[u.request_id].base_index
        for d in u.outputs:
            c = choices.setdefault(base + d.index, _Choice())
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
    for p in prompts.values():
        for j in range(req.n):
            idx = p.base_index + j
            c = choices.get(idx, _Choice(finish_reason="abort"))
            text = "".join(c.text)
            logprobs = None
            if req.logprobs is not None:
                ids, lps = list(c.token_ids), list(c.logprobs)
                if req.echo:
                    plp = prompt_lps.get(p.request_id) or [None] * len(p.ids)
                    ids, lps = p.ids + ids, list(plp) + lps
                logprobs, _ = await _completion_logprobs(ctx, ids, lps, 0)
            if req.echo:
                text = echo_texts[p.request_id] + text
            choice = {
                "index": idx,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
                choice["prompt_token_ids"] = p.ids
            out.append(choice)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage.usage(),
        **usage.response_extras(),
    }


async def _stream(
    ctx: ServingContext,
    req: CompletionRequest,
    model: str,
    rid: str,
    created: int,
    prompts: dict[str, _Prompt],
    echo_texts: dict[str, str],
    stream,
    buffered: list[RequestUpdate],
) -> AsyncIterator[bytes]:
    include_usage, continuous = stream_flags(req.stream_options)
    usage = UsageTracker()
    started: set[int] = set()
    offsets: dict[int, int] = {}
    failed = False
    async for batch in update_batches(stream, buffered):
        out: list[bytes] = []
        for u in batch:
            usage.add(u)
            if update_failed(u):
                out.append(sse(update_error(u).body()))
                failed = True
                break
            p = prompts[u.request_id]
            for d in u.outputs:
                idx = p.base_index + d.index
                text, ids, lps = d.text, d.token_ids, d.logprobs
                first = idx not in started
                started.add(idx)
                if first and req.echo:
                    text = echo_texts[p.request_id] + text
                    if req.logprobs is not None:
                        plp = u.prompt_logprobs or [None] * len(p.ids)
                        ids, lps = p.ids + ids, list(plp) + (lps or [])
                chunk_choice = {
                    "index": idx,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": d.finish_reason,
                    "stop_reason": d.stop_reason,
                }
                if req.logprobs is not None:
                    chunk_choice["logprobs"], offsets[idx] = await _completion_logprobs(
                        ctx, ids, lps or [], offsets.get(idx, 0)
                    )
                if req.return_token_ids:
                    chunk_choice["token_ids"] = d.token_ids
                    if first:
                        chunk_choice["prompt_token_ids"] = p.ids
                chunk = _chunk(rid, created, model, [chunk_choice])
                if include_usage:
                    chunk["usage"] = usage.usage(u.request_id) if continuous else None
                out.append(sse(chunk))
        if out:
            yield b"".join(out)
        if failed:
            stream.abort()
            break
    final = _chunk(rid, created, model, [])
    final["usage"] = usage.usage()
    yield (sse(final) if include_usage else b"") + DONE


def _chunk(rid: str, created: int, model: str, choices: list[dict]) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
