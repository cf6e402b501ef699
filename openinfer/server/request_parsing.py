"""Request bodies parsed into their pydantic models without holding the event loop for long.

A body of token ids is the expensive case: pydantic-core validates a 6 MB list of ints in ~0.8 s and holds the
GIL all the while, so a worker thread alone would not free the loop. Large bodies therefore go to one parsing thread
where the caller's size checks run first on the raw body (a 600k-item stop list or a prompt past the context is
refused before anything is decoded: body_precheck.py), then msgspec (about 10x faster on int lists) decodes the
JSON and the token-id fields are checked against their exact types; pydantic then
validates the rest of the decoded object with a one-element stand-in for each id list, and the checked list is put
back. Small bodies, and bodies that are not valid JSON, take pydantic's JSON path unchanged.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel, ValidationError

from openinfer.server.errors import APIError, validation_message
from openinfer.server.raw_json import split_top_level

M = TypeVar("M", bound=BaseModel)
Precheck = Callable[[dict[str, msgspec.Raw]], None]

LARGE_BODY_BYTES = 128 * 1024
# One thread for all large bodies: each new thread gets its own malloc arena, and arenas keep freed memory, so a
# pool of threads would hold several bodies' worth of RSS after a burst of large requests.
_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-parse")

# Fields that may carry long token-id lists: the msgspec types tried in order, with the stand-in for each.
_ID_FIELDS: dict[str, tuple[tuple[type, list], ...]] = {
    "prompt": ((list[int], [0]), (list[list[int]], [[0]])),
    "tokens": ((list[int], [0]),),
}


def parse(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body or b"null")
    except ValidationError as e:
        message, param = validation_message(e)
        raise APIError(message, 400, param) from None


def _parse_large(model: type[M], body: bytes, precheck: Precheck | None) -> M:
    top = split_top_level(body)
    if top is None:  # not a JSON object: pydantic says what is wrong
        return parse(model, body)
    if precheck is not None:
        precheck(top)
    del top
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, ValueError):  # ints past 64 bits: pydantic says what is wrong
        return parse(model, body)
    checked: dict[str, list] = {}
    for name, types in _ID_FIELDS.items():
        value = obj.get(name)
        if name not in model.model_fields or not isinstance(value, list) or not value:
            continue
        for typ, stand_in in types:
            try:
                checked[name] = msgspec.convert(value, typ, strict=True)
            except msgspec.ValidationError:
                continue
            obj[name] = stand_in
            break
    try:
        # The decoded JSON, validated in pydantic's (strict) Python mode: the same rules as its JSON mode for
        # what JSON can hold, without parsing the body a second time.
        req = model.model_validate(obj)
    except ValidationError as e:
        message, param = validation_message(e)
        raise APIError(message, 400, param) from None
    for name, ids in checked.items():
        setattr(req, name, ids)
    return req


async def parse_request(model: type[M], body: bytes, precheck: Precheck | None = None) -> M:
    """Parse ``body`` as ``model``; a 400 naming the field when it does not fit. For a large body,
    ``precheck(its top-level fields as raw JSON)`` runs before anything is decoded and may raise an ``APIError``."""
    if len(body) < LARGE_BODY_BYTES:
        return parse(model, body)
    return await asyncio.get_running_loop().run_in_executor(_POOL, _parse_large, model, body, precheck)


def _decode_large(body: bytes, precheck: Precheck | None) -> Any:
    top = split_top_level(body)
    if top is not None and precheck is not None:
        precheck(top)
    del top
    return msgspec.json.decode(body)


async def decode_json(body: bytes, precheck: Precheck | None = None) -> Any:
    """The body as plain JSON values (msgspec.DecodeError when it is not JSON); a large one decoded off the event
    loop after ``precheck`` on its raw top-level fields, as ``parse_request``."""
    if len(body) < LARGE_BODY_BYTES:
        return msgspec.json.decode(body)
    return await asyncio.get_running_loop().run_in_executor(_POOL, _decode_large, body, precheck)
