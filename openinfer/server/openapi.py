"""The server's OpenAPI schema at /openapi.json, with the request bodies the routes really accept.

The routes read their bodies themselves (``read_body`` + ``ServingContext.parse_request``: a size cap, strict
parsing, large bodies off the loop), so FastAPI cannot see their models; the pydantic schemas of ``protocol.py``
are put in here instead. Clients and schema-driven fuzzers (schemathesis, tests/test_fuzz_server.py) read it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from openinfer.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
_ERRORS = {
    "400": "invalid request (the error names the field)",
    "401": "missing or invalid API key",
    "413": "body too large",
    "429": "queue full",
    "503": "engine unavailable or draining",
}


def install_openapi(app: FastAPI, version: str) -> None:
    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in BODIES.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            op = schema["paths"][path]["post"]
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            responses = op.setdefault("responses", {})
            for status, text in _ERRORS.items():
                responses.setdefault(status, {"description": text})
        app.openapi_schema = schema
        return schema

    app.openapi = build
