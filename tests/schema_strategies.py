"""Hypothesis strategies for JSON schemas whose every instance is finite (bounded strings, arrays, integers, no
additional properties): a constrained generation must end by itself, so a 'length' finish is a failure."""
from __future__ import annotations

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


def json_schemas() -> st.SearchStrategy[dict]:
    return st.recursive(_leaf(), _extend, max_leaves=6)
