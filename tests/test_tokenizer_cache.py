"""The converted GGUF tokenizer kept on disk (openinfer/tokenizer_cache.py): an edited file makes a new entry, a
damaged entry is converted again, ``off`` keeps nothing, a quick conversion is not kept. That the kept tokenizer
is the converted one (same ids on 1,000 strings, specials, template) is test_gguf_tokenizer.py's check."""
from __future__ import annotations

import logging
import os

import pytest
from gguf_writer import write_gguf

from openinfer import tokenizer_cache
from openinfer.tokenizer import load_tokenizer

TEXT = "hello world, 12 tokens"


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("tok"), "llama", "Q8_0", layers=1)[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENINFER_TOKENIZER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_cache, "WORTH_S", 0.0)  # the toy vocabulary converts in well under a second
    return tmp_path / "cache"


def test_an_edited_file_gets_a_new_entry_and_a_damaged_one_is_converted_again(gguf_path, cache, caplog):
    want = load_tokenizer(str(gguf_path))(TEXT).input_ids
    (entry,) = cache.iterdir()
    assert load_tokenizer(str(gguf_path))(TEXT).input_ids == want
    st = gguf_path.stat()
    os.utime(gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # "edited": another mtime
    assert load_tokenizer(str(gguf_path))(TEXT).input_ids == want
    assert len(list(cache.iterdir())) == 2
    newest = next(e for e in cache.iterdir() if e != entry)
    (newest / "tokenizer.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="openinfer.tokenizer_cache"):
        assert load_tokenizer(str(gguf_path))(TEXT).input_ids == want
    assert "ignoring the cached tokenizer" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="openinfer.tokenizer_cache"):
        assert load_tokenizer(str(gguf_path))(TEXT).input_ids == want  # rewritten: read back without a warning
    assert not caplog.text
    assert not [e for e in cache.iterdir() if e.name.startswith(".tmp-")]


def test_off_and_quick_conversions_keep_nothing(gguf_path, cache, monkeypatch):
    monkeypatch.setenv("OPENINFER_TOKENIZER_CACHE", "off")
    assert tokenizer_cache.cache_dir() is None
    load_tokenizer(str(gguf_path))
    monkeypatch.setenv("OPENINFER_TOKENIZER_CACHE", str(cache))
    monkeypatch.setattr(tokenizer_cache, "WORTH_S", 1e9)
    load_tokenizer(str(gguf_path))
    assert not cache.exists() or not list(cache.iterdir())
