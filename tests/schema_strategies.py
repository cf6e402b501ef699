"""Hypothesis strategies for JSON schemas whose every instance is finite (bounded strings, arrays, integers, no
additional properties) and, given a budget, fits it: a constrained generation must end by itself within its
max_tokens, so a 'length' finish is a failure. Finite alone was not enough: arrays of up to 4 arrays of up to 4
objects allow ~600 characters of compact JSON, and the tests' char-level tokenizer spends a token per character,
so a model that kept choosing more items reached max_tokens=300 legitimately (a CI run drew such a schema)."""
from __future__ import annotations

import json
import string

from hypothesis import strategies as st

_NAMES = st.text(string.ascii_lowercase, min_size=1, max_size=6)


def _leaf() -> st.SearchStrategy[dict]:
    ints = st.integers(-500, 500)
    return st.one_of(
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.tuples(ints, st.integers(0, 600)).map(lambda t: {"type": "integer", "minimum": t[0],
                                                            "maximum": t[0] + t[1]}),
        st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
        st.lists(st.one_of(st.text(string.ascii_letters, max_size=5), st.integers(-9, 9)), min_size=1,
                 max_size=4, unique=True).map(lambda v: {"enum": v}),
        st.sampled_from(["^[a-z]{1,4}$", "^[0-9]{2}-[A-Z]$", "^(yes|no)$"]).map(
            lambda p: {"type": "string", "pattern": p}),
    )


def _extend(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    def obj(props: dict[str, dict], n_required: int) -> dict:
        names = sorted(props)
        return {"type": "object", "properties": props, "required": names[:n_required],
                "additionalProperties": False}

    objects = st.builds(obj, st.dictionaries(_NAMES, children, min_size=1, max_size=3), st.integers(0, 3))
    arrays = st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo,
                                                 "maxItems": lo + extra},
                       children, st.integers(0, 2), st.integers(0, 2))
    return st.one_of(objects, arrays)


_PATTERN_CHARS = {"^[a-z]{1,4}$": 4, "^[0-9]{2}-[A-Z]$": 4, "^(yes|no)$": 3}


def max_json_chars(schema: dict) -> int:
    """The longest compact JSON instance of a schema from these strategies, in characters (a string character
    counted as a 6-character escape, the worst JSON allows)."""
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema["type"]
    if kind == "boolean":
        return 5
    if kind == "null":
        return 4
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "string":
        return 2 + (_PATTERN_CHARS[schema["pattern"]] if "pattern" in schema else 6 * schema["maxLength"])
    if kind == "array":
        n = schema["maxItems"]
        return 2 + n * max_json_chars(schema["items"]) + max(n - 1, 0)
    props = schema["properties"]
    return 2 + sum(len(json.dumps(k)) + 1 + max_json_chars(v) for k, v in props.items()) + len(props) - 1


def json_schemas(max_chars: int | None = None) -> st.SearchStrategy[dict]:
    """Schemas whose every instance is finite; with ``max_chars``, also at most that long (one token per character
    with the tests' tokenizer, so a token budget of at least ``max_chars`` + 1 for EOS always suffices)."""
    schemas = st.recursive(_leaf(), _extend, max_leaves=6)
    return schemas if max_chars is None else schemas.filter(lambda s: max_json_chars(s) <= max_chars)
