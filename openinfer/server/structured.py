"""Structured-output requests on the HTTP side: OpenAI's ``response_format`` and vLLM's ``structured_outputs``
mapped onto ``StructuredOutputsParams``, and the grammar compiled (off the event loop, on the compiler's threads)
before the request is admitted, so a bad schema or regex is a 400 naming the field, never a 500 or a stuck
request."""

from __future__ import annotations

import asyncio
from typing import Any

from openinfer.sampling_params import StructuredOutputsParams
from openinfer.server.errors import APIError
from openinfer.structured_outputs.manager import GrammarCompiler


def _param(message: str, default: str) -> str:
    head = message.split(" ", 1)[0].rstrip(":,")
    return head if head.startswith("structured_outputs") else default


def from_response_format(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise APIError("response_format.json_schema must be an object with a 'schema' object", 400,
                           "response_format.json_schema")
        # OpenAI lets the schema be omitted ("any JSON"); an object is what json_schema users mean.
        return StructuredOutputsParams(json=js.get("schema") or {"type": "object"})
    raise APIError(f"response_format.type must be one of text, json_object, json_schema; got {kind!r}", 400,
                   "response_format.type")


def from_body(structured_outputs: dict[str, Any] | None, response_format: dict[str, Any] | None,
              ) -> StructuredOutputsParams | None:
    """The request's constraint, if any (a 400 when both forms are given, or either is malformed)."""
    if structured_outputs is not None and response_format and response_format.get("type", "text") != "text":
        raise APIError("send either structured_outputs or response_format, not both", 400, "structured_outputs")
    if structured_outputs is None:
        return from_response_format(response_format)
    known = {"json", "regex", "choice", "grammar", "json_object", "structural_tag"}
    unknown = sorted(set(structured_outputs) - known)
    if unknown:
        raise APIError(f"structured_outputs has unknown keys {unknown}; known: {sorted(known)}", 400,
                       "structured_outputs")
    try:
        return StructuredOutputsParams(**structured_outputs)
    except (ValueError, TypeError) as e:
        raise APIError(str(e), 400, _param(str(e), "structured_outputs")) from None


async def compile_or_400(compiler: GrammarCompiler, spec: StructuredOutputsParams | None,
                         field: str = "structured_outputs") -> None:
    """Wait for the grammar (cached after the first time) without blocking the loop."""
    if spec is None:
        return
    try:
        await asyncio.wrap_future(compiler.submit(spec))
    except ValueError as e:
        message = str(e)
        if field != "structured_outputs":  # response_format: name the user's field, keep the backend's reason
            message = message.replace(f"structured_outputs.{spec.kind}", f"{field} schema", 1)
        raise APIError(message, 400, _param(str(e), field) if field == "structured_outputs" else field) from None
