"""One streamed request against an OpenAI-compatible endpoint, timed the way ``vllm bench serve`` times it.

TTFT = send -> first chunk carrying output; ITL = gaps between later chunks carrying output (a chunk that
bundles several tokens is one gap); latency (E2EL) = send -> last chunk carrying output. Output tokens come
from the server's ``usage`` (we always ask for ``stream_options.include_usage``); a caller may re-tokenize
when a server sends none.

Transport: aiohttp, as in vLLM's benchmark client. One ``ClientSession`` per benchmark run (``open_session``)
holds the connection pool, so connections are reused across requests instead of paying a TCP handshake
inside every TTFT; aiohttp's C HTTP parser keeps the client's per-chunk CPU cost small (httpx spent about a
millisecond per streamed chunk, which on a small machine inflated the very TPOT/ITL it measured).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

# Whole-request limit (a long generation under heavy load is slow, not stuck) and connect limit, as vLLM.
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60, sock_connect=30)
# aiohttp refuses a line longer than twice its read buffer: accept 16 MiB SSE lines (prompts echoed back,
# big logprob blocks).
_READ_BUFSIZE = 1 << 23
# Idle pooled connections are dropped before uvicorn's 5 s keep-alive (vLLM, SGLang) closes them, so a
# request never goes out on a connection the server is closing (a POST is not retried).
_KEEPALIVE_S = 4.0


@dataclass
class RequestInput:
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    model: str
    api_url: str
    chat: bool = False
    ignore_eos: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, ... (only the ones set)
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestResult:
    success: bool = False
    generated_text: str = ""
    output_tokens: int = 0  # from server usage; 0 = unknown
    prompt_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # time.perf_counter() at send
    error: str = ""


def build_payload(inp: RequestInput) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": inp.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        **inp.sampling,
    }
    if inp.chat:
        content = inp.prompt if isinstance(inp.prompt, str) else str(inp.prompt)
        payload["messages"] = [{"role": "user", "content": content}]
        payload["max_completion_tokens"] = inp.output_len
    else:
        payload["prompt"] = inp.prompt
        payload["max_tokens"] = inp.output_len
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(inp.extra_body)
    return payload


def _chunk_output(choice: dict[str, Any], chat: bool) -> tuple[str, bool]:
    """The chunk's text, and whether the chunk carries output at all. Every completions chunk with a choice
    does (a token may decode to no text); a chat chunk that only announces the role does not."""
    if not chat:
        return choice.get("text") or "", True
    delta = choice.get("delta") or {}
    text = (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")
    role_only = (
        "role" in delta and not text and not choice.get("token_ids") and not choice.get("finish_reason")
    )
    return text, not role_only


def open_session(max_concurrency: int | None = None) -> aiohttp.ClientSession:
    """The run's session: a pool of at most ``max_concurrency`` connections (unbounded when None). Call
    from inside the event loop and close it (``async with``) when the run ends."""
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=_KEEPALIVE_S)
    return aiohttp.ClientSession(connector=connector, timeout=REQUEST_TIMEOUT, read_bufsize=_READ_BUFSIZE)


async def send_request(
    session: aiohttp.ClientSession, inp: RequestInput, headers: dict[str, str] | None = None
) -> RequestResult:
    """Stream one request and time it. Never raises (bar cancellation): a failure is recorded in
    ``error`` with ``success`` left False, so one bad request cannot end the run."""
    out = RequestResult(prompt_len=inp.prompt_len)
    decode = msgspec.json.decode
    text_parts: list[str] = []
    body = msgspec.json.encode(build_payload(inp))
    req_headers = {"Content-Type": "application/json", "Accept": "text/event-stream", **(headers or {})}
    st = time.perf_counter()
    out.start_time = st
    last = st
    try:
        async with session.post(inp.api_url, data=body, headers=req_headers) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode("utf-8", "replace")
                out.error = f"HTTP {resp.status}: {text[:500]}"
                return out
            async for line in resp.content:  # one SSE line per iteration, newline included
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":  # read on to the body's end: the connection then goes back to the pool
                    continue
                now = time.perf_counter()
                msg = decode(data)
                if "error" in msg and not msg.get("choices"):
                    err = msg["error"]
                    out.error = f"stream error: {err.get('message') if isinstance(err, dict) else err}"
                    return out
                usage = msg.get("usage")
                if usage:
                    out.output_tokens = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens"):
                        out.prompt_len = int(usage["prompt_tokens"])
                choices = msg.get("choices")
                if not choices:
                    continue
                text, has_output = _chunk_output(choices[0], inp.chat)
                if not has_output:
                    continue
                if out.ttft == 0.0:
                    out.ttft = now - st
                else:
                    out.itl.append(now - last)
                last = now
                text_parts.append(text)
        out.latency = last - st if out.ttft else time.perf_counter() - st
        out.generated_text = "".join(text_parts)
        if out.ttft == 0.0:
            out.error = "the stream ended without any output chunk"
        else:
            out.success = True
    except Exception as e:  # connection refused/reset, timeout, malformed stream, line too long, ...
        out.error = f"{type(e).__name__}: {e}"
    return out
