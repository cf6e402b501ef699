"""A GGUF file's tokenizer, converted once and kept on disk.

transformers' GGUF converter re-reads the whole vocabulary (SmolLM2: 49k tokens and 48k merges) in every process
that opens the file: 10 CPU s for SmolLM2 on this project's 2-core host, paid by every server, ``generate`` and
worker start. The converted fast tokenizer (after ``tokenizer.as_llama_cpp_splits``), saved with
``save_pretrained``, loads in 0.2 CPU s. The entry is keyed by the file's resolved path, size and modification time
and by the transformers / tokenizers versions and ``FORMAT`` (bumped whenever the conversion here changes), so an
edited or replaced file, or another converter, makes a new entry; it is written to a temporary folder and renamed,
so a process never reads a half-written one; a conversion quicker than ``WORTH_S`` is not kept. ``OPENINFER_TOKENIZER_CACHE`` names the folder (default
``~/.cache/openinfer/gguf_tokenizers``); ``off`` disables it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from openinfer import envs

logger = logging.getLogger(__name__)

FORMAT = 1  # the conversion's version: bump when tokenizer.load_tokenizer's GGUF path changes its result
WORTH_S = 1.0  # a quicker conversion (a small vocabulary: the tests' toy files) is not kept


def cache_dir() -> Path | None:
    value = envs.TOKENIZER_CACHE
    if value is not None and value.strip().lower() in ("0", "off", "false", "no"):
        return None
    if value:
        return Path(value).expanduser()
    return Path.home() / ".cache" / "openinfer" / "gguf_tokenizers"


def entry_key(gguf: Path) -> str:
    import tokenizers
    import transformers

    st = gguf.stat()
    h = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|"
                       f"{tokenizers.__version__}|{FORMAT}".encode())
    return f"{gguf.stem[:40]}-{h.hexdigest()[:16]}"


def load_or_convert(gguf: Path, convert: Callable[[], object]):
    """The cached tokenizer for ``gguf``, or ``convert()``'s, saved for the next process (a cache that cannot be
    read or written only costs the conversion)."""
    from transformers import AutoTokenizer

    root = cache_dir()
    if root is None:
        return convert()
    entry = root / entry_key(gguf)
    if entry.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - a damaged entry: convert again and replace it
            logger.warning("ignoring the cached tokenizer %s (%s)", entry, e)
    t0 = time.perf_counter()
    tok = convert()
    if time.perf_counter() - t0 < WORTH_S:
        return tok
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
        tok.save_pretrained(str(tmp))
        shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)  # another process's identical entry may have won the race: either is fine
    except OSError as e:
        logger.debug("tokenizer cache not written (%s)", e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok
