"""What /v1/completions, /v1/chat/completions and /v1/messages share: parsing and tokenizing (the checks are
request_validation.py's), admission, disconnect handling, usage, SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from openinfer.engine.llm_engine import LLMEngine
from openinfer.engine.request import INVALID_REQUEST
from openinfer.kv_events import KVEventsConfig
from openinfer.request_limits import DEFAULT_LIMITS, RequestLimits
from openinfer.server.chat_images import ChatImages
from openinfer.server.async_engine import AsyncEngine, EngineOverloaded, EngineUnavailable, RequestStream
from openinfer.server.body_precheck import precheck
from openinfer.server.errors import APIError
from openinfer.server.health import HealthSettings
from openinfer.server.messages import AddRequest, RequestUpdate
from openinfer.server.metrics import ServerMetrics
from openinfer.server.protocol import StreamOptions
from openinfer.server.reasoning import make_reasoning_parser
from openinfer.server.request_parsing import parse, parse_request
from openinfer.server.request_validation import RequestValidator
from openinfer.server.tokenizer_service import TokenizerService
from openinfer.server.tool_parsers import get_tool_parser
from openinfer.tokenizer import PromptTooLong

M = TypeVar("M", bound=BaseModel)
DONE = b"data: [DONE]\n\n"
# encode_prompt's probe: a long text is first tokenized only this many characters per context token, and refused
# when that head is already past the context by more than the margin.
PROBE_CHARS_PER_TOKEN = 8
PROBE_MARGIN_TOKENS = 64


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | list[str] | None = None  # any one of several is accepted
    max_queue: int = 1024
    max_body_bytes: int = 8 * 1024 * 1024
    drain_timeout_s: float = 30.0
    tool_call_parser: str | None = "hermes"  # tool_parsers/: how tool calls look in this model's output
    reasoning_parser: str | None = None  # reasoning/: split <think> ... </think> into reasoning_content
    limits: RequestLimits = DEFAULT_LIMITS  # caps on stop strings, token-id lists, grammars... per request
    health: HealthSettings = HealthSettings()  # readiness on failing steps, step watchdog, request timeout
    metrics_prefix: str = "openinfer"  # /metrics names: openinfer:... or vllm:... (metrics.py)
    kv_events: KVEventsConfig | None = None  # publish KV cache events for KV-aware routers (kv_events_publisher.py)
    # Also accepted as `model` but not listed by /v1/models: the --model path that clients sent before the shown id
    # became the checkpoint's base name (the path is not shown: it tells a client about the server's filesystem).
    model_aliases: tuple[str, ...] = ()


class ServingContext:
    def __init__(
        self,
        engine: LLMEngine,
        async_engine: AsyncEngine,
        tokenizers: TokenizerService,
        settings: ServerSettings,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.async_engine = async_engine
        self.tokenizers = tokenizers
        self.settings = settings
        self.metrics = metrics
        self.model_name = settings.served_model_names[0]
        self.model_path = engine.config.model.path
        self.max_model_len = engine.config.model.max_model_len
        self.vocab_size = engine.config.model.vocab_size
        self.kv_capacity_tokens = engine.kv_capacity_tokens
        self.created = int(time.time())
        self.tool_parser = get_tool_parser(settings.tool_call_parser) if settings.tool_call_parser else None
        make_reasoning_parser(settings.reasoning_parser)  # a bad name fails at start-up, not per request
        # The engine checks what it is given again (its add_request is an API of its own): with the same caps.
        engine.request_limits = settings.limits
        # Every check a request gets, and the engine request built from what passes (request_validation.py).
        self.validator = RequestValidator(
            served_model_names=settings.served_model_names,
            model_aliases=settings.model_aliases,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            kv_capacity_tokens=self.kv_capacity_tokens,
            max_sequences=async_engine.capacity,
            max_token_chars=tokenizers.max_token_chars,
            limits=settings.limits,
            defaults=engine.default_sampling_params(),
            tool_parser=self.tool_parser,
            grammar_compiler=engine.grammar_compiler,
            images=ChatImages.for_engine(engine.config.model, engine.tokenizer),
        )

    # -- parsing, tokenizing ----------------------------------------------------------------------
    @staticmethod
    def parse(model: type[M], body: bytes) -> M:
        return parse(model, body)

    async def parse_request(self, model: type[M], body: bytes) -> M:
        """``parse`` for route handlers: large bodies are decoded off the event loop, their sizes checked in the
        raw body before anything is decoded (body_precheck.py)."""
        return await parse_request(model, body, self._check_sizes)

    def _check_sizes(self, top: dict[str, msgspec.Raw]) -> None:
        precheck(self.validator, top)

    async def encode_prompt(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Tokenize a prompt with work bounded by the context length, not by the body: a text beyond the
        character bound is refused outright, and a long one is first tokenized only as far as
        ``PROBE_CHARS_PER_TOKEN`` characters per context token, refused if that head alone overflows."""
        v = self.validator
        v.check_prompt_chars(len(text), param)
        probe = self.max_model_len * PROBE_CHARS_PER_TOKEN
        if len(text) > 2 * probe:
            head = await self.tokenizers.encode(text[:probe], add_special_tokens=add_special_tokens)
            # Tokens near the cut may merge differently in the whole text: leave a margin for them.
            if len(head) - PROBE_MARGIN_TOKENS >= self.max_model_len:
                raise v.too_long(
                    f"your request has more than {len(head) - PROBE_MARGIN_TOKENS} input tokens (its first "
                    f"{probe} characters alone are {len(head)} tokens)",
                    param,
                )
        return await self.tokenizers.encode(text, add_special_tokens=add_special_tokens)

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          continue_final_message: bool = False,
                          template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Checked chat messages through the chat template, tokenized. The rendered text (tools and template
        kwargs included) is refused past the character bound before it is tokenized; a template that fails on
        the client's messages (or kwargs) is a 400 on ``messages``."""
        try:
            return await self.tokenizers.apply_chat_template(
                messages, add_generation_prompt, self.validator.max_prompt_chars,
                continue_final_message=continue_final_message, **(template_kwargs or {})
            )
        except APIError:
            raise
        except PromptTooLong as e:
            self.validator.check_prompt_chars(e.num_chars, "messages")
            raise
        except Exception as e:  # template errors are the client's messages meeting the template
            raise APIError(f"cannot apply the chat template: {e}", 400, "messages") from None

    # -- admission -------------------------------------------------------------------------------
    async def start(self, adds: list[AddRequest]) -> tuple[RequestStream, list[RequestUpdate]]:
        """Admit the engine requests and wait until the core has accepted (or rejected) each one, so a bad
        request is still a clean 4xx before any streaming starts. Returns the stream and any outputs that
        arrived meanwhile."""
        try:
            stream = self.async_engine.submit(adds)
        except EngineOverloaded as e:
            if self.metrics is not None:
                self.metrics.on_rejected("queue_full")
            raise APIError(str(e), 429, code="queue_full", headers={"Retry-After": "1"}) from None
        except EngineUnavailable as e:
            if self.metrics is not None:
                self.metrics.on_rejected("unavailable")
            raise APIError(str(e), 503, code="unavailable") from None
        waiting = set(stream.request_ids)
        buffered: list[RequestUpdate] = []
        error: RequestUpdate | None = None
        try:
            while waiting:
                u = await stream.get()
                if u.request_id in waiting and (u.accepted or u.error):
                    waiting.discard(u.request_id)
                    if u.error and error is None:
                        error = u
                elif not u.accepted:
                    buffered.append(u)
        except BaseException:
            stream.abort()
            raise
        if error is not None:
            stream.abort()
            if error.error_kind == "invalid":
                raise APIError(error.error or "invalid request", 400)
            raise ended_error(error)
        return stream, buffered

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"


async def updates(stream: RequestStream, buffered: list[RequestUpdate]) -> AsyncIterator[RequestUpdate]:
    for u in buffered:
        yield u
    while not stream.done:
        for u in await stream.get_batch():
            yield u


async def update_batches(
    stream: RequestStream,
    buffered: list[RequestUpdate],
) -> AsyncIterator[list[RequestUpdate]]:
    if buffered:
        yield buffered
    while not stream.done:
        yield await stream.get_batch()


# -- usage ---------------------------------------------------------------------------------------


@dataclass
class UsageTracker:
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: dict[str, int] = field(default_factory=dict)
    # Disaggregated prefill/decode: where the request's KV waits (vLLM returns it at the top of the response).
    kv_transfer_params: dict | None = None

    def add(self, u: RequestUpdate) -> None:
        rid = u.request_id
        if u.kv_transfer_params is not None:
            self.kv_transfer_params = u.kv_transfer_params
        if u.num_prompt_tokens:
            self.prompt_tokens[rid] = u.num_prompt_tokens
        self.cached_tokens[rid] = max(self.cached_tokens.get(rid, 0), u.num_cached_tokens)
        self.completion_tokens[rid] = self.completion_tokens.get(rid, 0) + sum(
            len(d.token_ids) for d in u.outputs
        )

    def response_extras(self) -> dict:
        return {} if self.kv_transfer_params is None else {"kv_transfer_params": self.kv_transfer_params}

    def usage(self, request_id: str | None = None) -> dict:
        keys = [request_id] if request_id is not None else list(self.prompt_tokens)
        p = sum(self.prompt_tokens.get(k, 0) for k in keys)
        c = sum(self.completion_tokens.get(k, 0) for k in keys)
        cached = sum(self.cached_tokens.get(k, 0) for k in keys)
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def update_failed(u: RequestUpdate) -> bool:
    return bool(u.error) or any(d.finish_reason == "error" for d in u.outputs)


def engine_error_message(u: RequestUpdate | None) -> str:
    return (u.error if u is not None else None) or "the engine failed while generating this request"


def finish_error(stop_reason: int | str | None, u: RequestUpdate | None = None) -> APIError:
    """The error for a choice that finished with 'error': a 400 naming the field when the request's own input
    made it fail (the engine says so in the stop reason), else a 500."""
    if isinstance(stop_reason, str) and stop_reason.startswith(INVALID_REQUEST):
        message = stop_reason[len(INVALID_REQUEST):]
        return APIError(message, 400, message.split(" ", 1)[0])
    return APIError(engine_error_message(u), 500, code="engine_error")


def ended_error(u: RequestUpdate) -> APIError:
    """The error for an update that ended its request with ``error`` set: 504 when the request outran the
    server's request timeout, else 503 (the engine is gone)."""
    if u.error_kind == "timeout":
        return APIError(u.error or "request timeout", 504, code="timeout")
    return APIError(u.error or "engine error", 503, code="engine_error")


def update_error(u: RequestUpdate) -> APIError:
    """The error to report for an update that ``update_failed``."""
    if u.error_kind == "timeout":
        return ended_error(u)
    reason = next((d.stop_reason for d in u.outputs if d.finish_reason == "error"), None)
    return finish_error(None if u.error else reason, u)


def stream_flags(options: StreamOptions | None) -> tuple[bool, bool]:
    if options is None:
        return False, False
    return options.include_usage, options.continuous_usage_stats


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def json_bytes(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


# -- disconnects ---------------------------------------------------------------------------------


class EngineStreamingResponse(StreamingResponse):
    """SSE response that aborts its engine requests however the response ends: finished, client gone
    (Starlette cancels the body task), or a send error."""

    def __init__(self, content: AsyncIterator[bytes], stream: RequestStream) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.engine_stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.engine_stream.abort()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[Any], stream: RequestStream) -> Any:
    """Run a non-streaming handler's work, but abort its engine requests as soon as the client goes away
    (Starlette does not cancel non-streaming handlers on disconnect)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            stream.abort()
    if task in done:
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()
