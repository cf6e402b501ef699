"""The raw-body measurements the server refuses large requests by (server/raw_json.py) agree with decoding: item
counts of arrays and objects, characters of strings, token-id list lengths, for any JSON (hypothesis), including
scans that cross slice boundaries mid-string, mid-escape and mid-character."""
import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import openinfer.server.raw_json as raw_json
from openinfer.server.raw_json import container_items, number_items, split_top_level, string_chars

# Text that stresses the scanner: quotes, backslashes, brackets and commas inside strings, multi-byte characters.
TEXT = st.text(alphabet=st.sampled_from(list('"\\,[]{}: a\u00e9\u4e2d\U0001F600\n\t')), max_size=12)
SCALARS = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | TEXT
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TEXT, inner, max_size=4),
                      max_leaves=30)


def _raw(value, **dumps) -> msgspec.Raw:
    top = split_top_level(b'{"v": ' + json.dumps(value, **dumps).encode() + b"}")
    assert top is not None
    return top["v"]


@pytest.fixture(params=[3, 7, 64 << 10], ids=["slice3", "slice7", "slice64k"])
def slices(request):
    saved = raw_json._SLICE, raw_json._NUMPY_SLICE
    raw_json._SLICE = raw_json._NUMPY_SLICE = request.param
    yield
    raw_json._SLICE, raw_json._NUMPY_SLICE = saved


# The fixture only sets the slice size, the same for every example: safe to share across them.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=VALUES, ascii_only=st.booleans(), compact=st.booleans())
def test_measurements_match_decoding(slices, value, ascii_only, compact):
    dumps = {"ensure_ascii": ascii_only, "separators": (",", ":") if compact else (", ", ": ")}
    raw = _raw(value, **dumps)
    assert container_items(raw) == (len(value) if isinstance(value, (list, dict)) else None)
    assert string_chars(raw) == (len(value) if isinstance(value, str) else None)
    flat_numbers = isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   for v in value)
    if flat_numbers:
        assert number_items(raw) == len(value)
    elif not isinstance(value, list) or any(isinstance(v, (str, list, dict)) for v in value):
        assert number_items(raw) is None


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"not json", b"", b"{"])
def test_split_top_level_is_none_for_anything_but_an_object(body):
    assert split_top_level(body) is None


def test_a_six_megabyte_id_list_is_counted_without_decoding_it():
    body = bytearray(json.dumps({"prompt": [5] * (2 << 20)}).encode())
    top = split_top_level(body)
    assert number_items(top["prompt"]) == 2 << 20 and container_items(top["prompt"]) == 2 << 20
    body[-2:-1] = b" "  # the views point into the body: no copy was made
    assert bytes(top["prompt"])[-1:] == b" "
