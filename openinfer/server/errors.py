"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

Every client mistake becomes an ``APIError`` with a 4xx status before the request reaches the engine; only a
fault of the server itself may answer 5xx.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param, self.code)


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    message: str,
    status: int,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(
        msgspec.json.encode(error_body(message, status, param, code)),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_response(exc: APIError) -> Response:
    """``{"type": "error", "error": {"type", "message"}}``; the field a 400 is about leads the message."""
    message = exc.message if not exc.param or exc.param in exc.message else f"{exc.param}: {exc.message}"
    body = {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(exc.status, "api_error"), "message": message}}
    return Response(msgspec.json.encode(body), status_code=exc.status, media_type="application/json",
                    headers=exc.headers)


def validation_message(e: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """A one-line message naming the offending fields, and the first one as ``param``."""
    errors = e.errors()
    parts = []
    param = None
    for err in errors[:5]:
        # Drop union-branch names (e.g. 'list[int]') from the location: the client only knows its fields.
        loc = [
            str(x)
            for x in err.get("loc", ())
            if not (
                isinstance(x, str)
                and ("[" in x or x in {"str", "int", "float", "bool", "function-after", "function-plain"})
            )
        ]
        where = ".".join(loc) or "body"
        param = param or where
        msg = err.get("msg", "invalid")
        if err.get("type") == "json_invalid":
            msg = f"the body is not valid JSON ({err.get('ctx', {}).get('error', msg)})"
        parts.append(f"{where}: {msg}")
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return "invalid request: " + "; ".join(dict.fromkeys(parts)) + more, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        if request.url.path.startswith("/v1/messages"):  # Anthropic clients read their own error shape
            return anthropic_error_response(exc)
        return error_response(exc.message, exc.status, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        message, param = validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
        if status == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(message, status, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(f"internal server error: {type(exc).__name__}", 500)
