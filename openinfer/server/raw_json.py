"""Sizes of JSON values measured in the raw body, without decoding them.

A refused request should cost the server no more memory than its body. Decoding first and checking after does not:
a 6 MB list of token ids becomes ~60 MB of Python ints (and glibc keeps part of it afterwards), a 600k-item stop
list ~40 MB; msgspec's ``max_length`` is checked only after the whole array is built. So the large-body path splits
the body's top level into ``msgspec.Raw`` views (zero-copy: they point into the body), measures here the fields that
have caps, and refuses before anything else is decoded. The scans below read the body in 64 KiB slices, so the
extra memory is one slice.
"""
from __future__ import annotations

import re

import msgspec
import numpy as np

_SLICE = 64 << 10  # small enough that the slices come from (and return to) the heap, not fresh mmaps
_NUMPY_SLICE = 16 << 10  # ~10 int32 temporaries per slice: 64 KiB each
_EMPTY = re.compile(rb"[\[{]\s*[\]}]")
_UTF8_CONTINUATION = bytes(range(0x80, 0xC0))


def split_top_level(body: bytes | bytearray) -> dict[str, msgspec.Raw] | None:
    """The body's top-level object as raw views into ``body``; None when the body is not a JSON object (the caller's
    full parse then reports what is wrong)."""
    try:
        return msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _slices(view: memoryview):
    for i in range(0, len(view), _SLICE):
        yield bytes(view[i:i + _SLICE])


def _count(view: memoryview, byte: bytes) -> int:
    return sum(s.count(byte) for s in _slices(view))


def container_items(raw: msgspec.Raw) -> int | None:
    """How many items a JSON array (or members a JSON object) holds at its top level; None for any other value."""
    view = memoryview(raw)
    if not len(view) or view[0] not in b"[{":
        return None
    flat = number_items(raw)
    if flat is not None:
        return flat
    if _EMPTY.fullmatch(view):
        return 0
    return _top_level_commas(np.frombuffer(view, dtype=np.uint8)) + 1


def _top_level_commas(data: np.ndarray) -> int:
    """Commas outside string literals at nesting depth 1, counted slice by slice with numpy (a 600k-item stop list
    in tens of ms, no Python object per item). The state carried between slices: whether the slice starts inside a
    string, the nesting depth, and how many backslashes end the previous slice (a quote after an odd run of them is
    escaped)."""
    commas = depth = 0
    in_string = False
    backslash_run = 0
    for start in range(0, len(data), _NUMPY_SLICE):
        c = data[start:start + _NUMPY_SLICE]
        pos = np.arange(len(c), dtype=np.int32)
        is_bs = c == 0x5C
        # For each position, the last non-backslash at or before it; a quote at p is escaped when the backslashes
        # right before it (those after that index, plus the previous slice's trailing run) are odd in number.
        last_plain = np.maximum.accumulate(np.where(is_bs, np.int32(-1), pos))
        quotes = np.flatnonzero(c == 0x22)
        before = np.where(quotes > 0, last_plain[np.maximum(quotes - 1, 0)], -1)
        run = np.where(before >= 0, quotes - 1 - before, quotes + backslash_run)
        real = np.zeros(len(c), dtype=np.int8)
        real[quotes[run % 2 == 0]] = 1
        inside = ((np.cumsum(real, dtype=np.int32) + in_string) % 2).astype(bool)
        opens = ((c == 0x5B) | (c == 0x7B)) & ~inside
        closes = ((c == 0x5D) | (c == 0x7D)) & ~inside
        level = depth + np.cumsum(opens.astype(np.int32) - closes, dtype=np.int32)
        commas += int(np.count_nonzero((c == 0x2C) & ~inside & (level == 1)))
        depth = int(level[-1])
        in_string = bool(inside[-1])
        trailing = len(c) - 1 - int(last_plain[-1])
        backslash_run = trailing + (backslash_run if last_plain[-1] < 0 else 0)
    return commas


def number_items(raw: msgspec.Raw) -> int | None:
    """How many items a flat JSON array of numbers holds (a token-id list); None for any other value. Counted from
    its commas alone, so a 6 MB list costs a few byte scans."""
    view = memoryview(raw)
    if not len(view) or view[0] != 0x5B or _count(view, b'"') or _count(view, b"[") + _count(view, b"{") != 1:
        return None
    commas = _count(view, b",")
    return commas + 1 if commas else (0 if _EMPTY.fullmatch(view) else 1)


def string_chars(raw: msgspec.Raw) -> int | None:
    """How many characters a JSON string literal decodes to (what ``len(str)`` says); None for any other value."""
    view = memoryview(raw)
    if not len(view) or view[0] != 0x22:
        return None
    if _count(view, b"\\"):
        return len(msgspec.json.decode(raw, type=str))  # escapes: decode this one string (rare in a long text)
    chars = len(view) - 2
    for s in _slices(view):
        if not s.isascii():
            chars -= len(s) - len(s.translate(None, _UTF8_CONTINUATION))  # each continuation byte ends no char
    return chars


def decode_or_none(raw: msgspec.Raw, typ: type):
    """``raw`` decoded as ``typ`` (a shallow type such as ``list[msgspec.Raw]``); None when it does not fit."""
    try:
        return msgspec.json.decode(raw, type=typ)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
