"""One streamed request against an OpenAI-compatible endpoint, timed the way ``vllm bench serve`` times it.

TTFT = send -> first chunk carrying output; ITL = gaps between later chunks carrying output (a chunk that
bundles several tokens is one gap); latency (E2EL) = send -> last chunk carrying output. Output tokens come
from the server's ``usage`` (we always ask for ``stream_options.include_usage``); a caller may re-tokenize
when a server sends none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from openinfer.bench.sse_http import post


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


async def send_request(inp: RequestInput, headers: dict[str, str] | None = None) -> RequestResult:
    out = RequestResult(prompt_len=inp.prompt_len)
    decode = msgspec.json.decode
    text_parts: list[str] = []
    body = msgspec.json.encode(build_payload(inp))
    st = time.perf_counter()
    out.start_time = st
    last = st
    resp = None
    try:
        resp = await post(inp.api_url, body, headers)
        if resp.status != 200:
            text = (await resp.read()).decode("utf-8", "replace")
            out.error = f"HTTP {resp.status}: {text[:500]}"
            return out
        async for line in resp.lines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
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
    except (OSError, EOFError, ValueError, msgspec.DecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        if resp is not None:
            resp.close()
    return out
