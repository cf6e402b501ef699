"""One streamed agentic request: timings as ``bench serve`` defines them, the server's usage (prompt,
cached, completion tokens), and a failure category.

Categories: ``context_overflow`` (an error body that says the prompt does not fit, the phrases AgentX
matches), ``http_4xx``, ``http_5xx``, ``stalled`` (no bytes for ``stall_timeout_s`` once the request is
sent, so a hung stream ends instead of holding its lane forever), ``stream_error`` (an error event inside
the stream), ``incomplete`` (the stream ended without output or without usage, so the request cannot be
accounted), ``transport`` (connection refused/reset, malformed stream).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec

OVERFLOW_PHRASES = ("context length", "maximum context", "context_length_exceeded", "prompt is too long")


def is_context_overflow(text: str) -> bool:
    low = text.lower()
    return any(p in low for p in OVERFLOW_PHRASES)


@dataclass
class AgenticResult:
    success: bool = False
    category: str = ""  # failure category; "" on success
    error: str = ""
    prompt_tokens: int = 0  # server usage
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0  # time.perf_counter() at send
    end: float = 0.0

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def _fail(out: AgenticResult, category: str, error: str) -> AgenticResult:
    out.category, out.error = category, error
    out.end = time.perf_counter()
    return out


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict,
    headers: dict[str, str],
    stall_timeout_s: float,
) -> AgenticResult:
    """POST ``payload`` (``stream`` and ``include_usage`` set here) and read the stream. Never raises
    (bar cancellation)."""
    out = AgenticResult()
    body = msgspec.json.encode({**payload, "stream": True, "stream_options": {"include_usage": True}})
    req_headers = {"Content-Type": "application/json", "Accept": "text/event-stream", **headers}
    # sock_read bounds the wait for every read, the first byte included: a stall anywhere trips it.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=stall_timeout_s)
    decode = msgspec.json.decode
    usage = None
    st = out.start = time.perf_counter()
    last = st
    try:
        async with session.post(url, data=body, headers=req_headers, timeout=timeout) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode("utf-8", "replace")
                cat = "http_5xx" if resp.status >= 500 else "http_4xx"
                if is_context_overflow(text):
                    cat = "context_overflow"
                return _fail(out, cat, f"HTTP {resp.status}: {text[:500]}")
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    continue
                now = time.perf_counter()
                msg = decode(data)
                if "error" in msg and not msg.get("choices"):
                    err = msg["error"]
                    text = str(err.get("message") if isinstance(err, dict) else err)
                    cat = "context_overflow" if is_context_overflow(text) else "stream_error"
                    return _fail(out, cat, f"stream error: {text}")
                if msg.get("usage"):
                    usage = msg["usage"]
                if not msg.get("choices"):
                    continue
                if out.ttft == 0.0:
                    out.ttft = now - st
                else:
                    out.itl.append(now - last)
                last = now
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as e:
        return _fail(out, "stalled", f"no data for {stall_timeout_s:g}s ({type(e).__name__})")
    except Exception as e:  # refused/reset connection, malformed SSE, ...
        return _fail(out, "transport", f"{type(e).__name__}: {e}")
    out.end = time.perf_counter()
    if out.ttft == 0.0:
        return _fail(out, "incomplete", "the stream ended without any output chunk")
    if not usage:
        return _fail(out, "incomplete", "the stream ended without a usage block")
    out.latency = last - st
    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    out.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    out.cached_tokens = int(details.get("cached_tokens") or 0)
    out.success = True
    return out
