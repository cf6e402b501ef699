"""The FastAPI app: routes, auth and body-size guard, health, metrics, drain.

``build_app(engine, settings)`` wires an already-loaded ``LLMEngine``; the core thread starts with the app's
lifespan and stops with it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

import msgspec
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from openinfer.engine.llm_engine import LLMEngine
from openinfer.server.async_engine import AsyncEngine, EngineUnavailable
from openinfer.server.connections import conn_log
from openinfer.server.errors import APIError, error_body, install_error_handlers
from openinfer.server.health import Watchdog, liveness_problem, readiness_problem
from openinfer.server.kv_events_publisher import start_kv_events
from openinfer.server.metrics import CONTENT_TYPE, ServerMetrics
from openinfer.server.memory import TrimAfterLargeBody
from openinfer.server.openapi import install_openapi
from openinfer.server.protocol import DetokenizeRequest, TokenizeRequest
from openinfer.server.router_endpoints import install_router_endpoints
from openinfer.server.serving import ServerSettings, ServingContext, json_bytes
from openinfer.server.serving_chat import create_chat_completion
from openinfer.server.serving_completion import create_completion
from openinfer.server.serving_messages import count_tokens, create_message
from openinfer.server.tokenizer_service import TokenizerService

logger = logging.getLogger(__name__)

CONTROL_WAIT_S = 5.0  # /reset_prefix_cache waits this long for the core (it answers between steps), then 503
_OPEN_PATHS = {"/health", "/health/ready", "/metrics", "/ping", "/version"}


class GuardMiddleware:
    """Pure ASGI (no buffering, no interference with streaming or cancellation): API key, then body size
    from Content-Length. Bodies without a length are capped while they are read (``read_body``)."""

    def __init__(self, app: ASGIApp, api_key: str | list[str] | None, max_body_bytes: int) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        # Any one of them is accepted (vLLM's --api-key takes several, e.g. while rotating keys)
        self.api_keys = tuple(k.encode() for k in keys if k) or None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_keys is not None and scope["path"] not in _OPEN_PATHS:
            token = bearer_token(headers.get(b"authorization", b""))
            # every key compared (a list, not any() over a generator): the time taken says nothing of which matched
            if not any([hmac.compare_digest(token, key) for key in self.api_keys]):
                return await _send_error(
                    send,
                    "missing or invalid API key (send 'Authorization: Bearer <key>')",
                    401,
                    {"WWW-Authenticate": "Bearer"},
                )
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await _send_error(send, "invalid Content-Length header", 400)
            if n > self.max_body_bytes:
                return await _send_error(
                    send, f"request body of {n} bytes exceeds the limit of {self.max_body_bytes} bytes", 413
                )
        await self.app(scope, receive, send)


def bearer_token(authorization: bytes) -> bytes:
    """The credentials of an ``Authorization: Bearer <token>`` header; b"" for another scheme. The scheme is
    case-insensitive and may be followed by more than one space (RFC 7235 section 2.1), so ``bearer x`` is x."""
    scheme, _, token = authorization.strip().partition(b" ")
    return token.strip(b" ") if scheme.lower() == b"bearer" else b""


async def _send_error(send: Send, message: str, status: int, headers: dict[str, str] | None = None) -> None:
    body = msgspec.json.encode(error_body(message, status))
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def read_body(request: Request, limit: int) -> bytearray:
    """The whole body, held once: with a Content-Length the buffer is allocated at its size and filled in place
    (joining a list of chunks would hold the body twice at the peak); a chunked upload grows one buffer."""
    declared = request.headers.get("content-length", "")
    body = bytearray(int(declared)) if declared.isdigit() and int(declared) <= limit else bytearray()
    size = 0
    try:
        async for chunk in request.stream():
            end = size + len(chunk)
            if end > limit:
                raise APIError(f"request body exceeds the limit of {limit} bytes", 413)
            body[size:end] = chunk  # in place while within the preallocated size, growing past it
            size = end
    except ClientDisconnect:
        # A client gone mid-upload is the client's business, not a server error: no traceback (uvicorn and the
        # catch-all handler would log two per disconnect), one rate-limited line. The answer goes nowhere.
        conn_log(logging.INFO, "upload-gone", "a client disconnected while sending its request body")
        raise APIError("the client disconnected while sending the request body", 400) from None
    del body[size:]
    return body


def build_app(engine: LLMEngine, settings: ServerSettings, chat_template: str | None = None) -> FastAPI:
    holder: dict[str, AsyncEngine] = {}
    metrics = ServerMetrics(settings.served_model_names[0], lambda: holder["engine"].stats, settings.metrics_prefix)
    async_engine = AsyncEngine(engine, settings.max_queue, metrics)
    holder["engine"] = async_engine
    tokenizers = TokenizerService(engine.config.model.tokenizer_path, chat_template, engine.config.tokenizer_mode)
    ctx = ServingContext(engine, async_engine, tokenizers, settings, metrics)
    validator = ctx.validator
    watchdog = Watchdog(async_engine, settings.health)
    kv_events = start_kv_events(engine, async_engine, settings.kv_events)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        watchdog.start()
        try:
            yield
        finally:
            await watchdog.stop()
            async_engine.abort_all()
            await async_engine.stop()
            tokenizers.close()
            if kv_events is not None:
                kv_events.shutdown()

    app = FastAPI(
        title="openinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json"
    )
    app.state.ctx = ctx
    app.state.async_engine = async_engine
    install_error_handlers(app)
    from openinfer import __version__

    install_openapi(app, __version__)
    app.add_middleware(TrimAfterLargeBody)  # innermost: runs once the route (and its objects) are done
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)

    def json_response(obj, status: int = 200) -> Response:
        return Response(json_bytes(obj), status_code=status, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(ctx, request, await read_body(request, settings.max_body_bytes))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(ctx, request, await read_body(request, settings.max_body_bytes))

    @app.post("/v1/messages")
    async def anthropic_messages(request: Request) -> Response:
        return await create_message(ctx, request, await read_body(request, settings.max_body_bytes))

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(request: Request) -> Response:
        return await count_tokens(ctx, await read_body(request, settings.max_body_bytes))

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": ctx.created,
                "owned_by": "openinfer",
                "root": name,  # vLLM shows the checkpoint path here; a client has no use for the server's paths
                "parent": None,
                "max_model_len": ctx.max_model_len,
                # vLLM's ModelPermission, with vLLM's values (what a client may do with the model)
                "permission": [{
                    "id": f"modelperm-{name}", "object": "model_permission", "created": ctx.created,
                    "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                    "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                    "organization": "*", "group": None, "is_blocking": False,
                }],
            }
            for name in settings.served_model_names
        ]
        return json_response({"object": "list", "data": cards})

    @app.get("/health")
    async def health() -> Response:
        problem = liveness_problem(async_engine, settings.health, time.monotonic())
        if problem is not None:
            return json_response(error_body(problem, 503), 503)
        return json_response({"status": "ok"})

    # vLLM's and SageMaker's liveness route (GET and POST, as vLLM serves it): the same answer as /health
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/health/ready")
    async def ready() -> Response:
        s = async_engine.stats
        now = time.monotonic()
        info = {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_steps": s.num_steps,
            "heartbeat_age_s": round(now - s.heartbeat_s, 3),
            "draining": async_engine.draining,
            "consecutive_failed_steps": s.consecutive_failed_steps,
        }
        problem = readiness_problem(async_engine, settings.health, now)
        if problem:
            return json_response({"status": "unavailable", "reason": problem, **info}, 503)
        return json_response({"status": "ready", **info})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> Response:
        from openinfer import __version__

        return json_response({"version": __version__})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await ctx.parse_request(TokenizeRequest, await read_body(request, settings.max_body_bytes))
        validator.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("send exactly one of 'prompt' or 'messages'", 400, "prompt")
        if req.messages is not None:
            urls: list = []
            images = validator.images
            messages = validator.chat_messages(req.messages, images.placeholder if images else None, urls)
            validator.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
            kwargs = dict(req.chat_template_kwargs or {})
            if req.tools is not None:
                kwargs["tools"] = req.tools
            ids = await ctx.render_chat(messages, req.add_generation_prompt, req.continue_final_message, kwargs)
            if urls:  # the image positions counted as the model will see them
                images.check_count(len(urls))
                ids, _ = images.place(ids, [images.read(url, where) for url, where in urls])
        else:
            ids = await ctx.encode_prompt(req.prompt, add_special_tokens=req.add_special_tokens)
        out = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = await tokenizers.token_strs(ids)
        return json_response(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await ctx.parse_request(DetokenizeRequest, await read_body(request, settings.max_body_bytes))
        validator.check_model(req.model)
        if req.tokens:
            validator.check_prompt_ids(req.tokens, "tokens")  # in the vocabulary, and no more than a context's worth
        return json_response({"prompt": await tokenizers.decode(req.tokens)})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        try:
            dropped = await async_engine.control("reset_prefix_cache", CONTROL_WAIT_S)
        except EngineUnavailable as e:
            raise APIError(str(e), 503, code="unavailable") from None
        except TimeoutError:  # a step is running long (or is stuck): say so now instead of holding the client
            raise APIError(f"the engine did not answer within {CONTROL_WAIT_S:g}s (a step is still running); "
                           "retry later", 503, code="unavailable", headers={"Retry-After": "5"}) from None
        return json_response({"status": "ok", "num_blocks_dropped": dropped})

    install_router_endpoints(app, ctx)
    return app


async def drain(app: FastAPI, timeout_s: float) -> None:
    """Stop admitting (new requests get 503), let running ones finish for up to ``timeout_s``, then abort
    what is left and wait for those streams to close."""
    eng: AsyncEngine = app.state.async_engine
    eng.draining = True
    logger.info("draining: %d sequences in flight, waiting up to %.0fs", eng.num_in_flight, timeout_s)
    deadline = time.monotonic() + timeout_s
    while eng.num_in_flight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if eng.num_in_flight > 0:
        logger.warning("drain timeout: aborting %d sequences", eng.num_in_flight)
        eng.abort_all()
        end = time.monotonic() + 5.0
        while eng.num_in_flight > 0 and time.monotonic() < end:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)  # let the last SSE chunks reach their sockets
    logger.info("drain complete")
