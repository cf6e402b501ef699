"""Tokenizer and chat template from an HF-format folder, offline (tokenizers via transformers)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from openinfer import tokenizer_cache
from openinfer.gguf_file import GGUFError, field, find_gguf, open_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def load_tokenizer(path: str, chat_template: str | None = None):
    """From an HF-format folder, or from a GGUF file's vocabulary and chat template (``tokenizer.ggml.*``), which
    transformers' GGUF converter turns into the same fast tokenizer llama.cpp's vocabulary describes (BPE / gpt2
    with the pre-tokenizer the file names, SentencePiece / llama)."""
    from transformers import AutoTokenizer

    gguf = find_gguf(path)
    try:
        if gguf is not None:
            def convert():  # not run when tokenizer_cache has this file's conversion (the file unchanged since)
                reader = open_gguf(gguf)  # a corrupt file: our one-line error, not the converter's
                tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
                as_llama_cpp_splits(tok, reader)
                return tok

            tok = tokenizer_cache.load_or_convert(gguf, convert)
        else:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except GGUFError:
        raise
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from None
    if chat_template is not None:
        p = Path(chat_template)
        tok.chat_template = p.read_text() if p.is_file() else chat_template
    return tok


def as_llama_cpp_splits(tok, reader) -> None:
    """Where transformers' GGUF converter and llama.cpp split text differently, take llama.cpp's way (the file
    was made for it; tests/test_gguf_tokenizer.py checks both on 1,000 strings against llama.cpp's own ids):
    - SentencePiece (``llama``) vocabularies with ``add_space_prefix``: llama.cpp puts one space before every
      piece of text that starts the input or follows a special token, even when the text starts with spaces
      (``"  a"`` -> "▁▁▁a"); the converter's ``Metaspace(prepend_scheme="first")`` skips text that starts with
      one. A normaliser that always prepends, applied per piece between special tokens, is llama.cpp's rule.
    - BPE pre-tokenizer types the converter has no regex for, from llama.cpp's ``llama-vocab.cpp``: ``smollm``
      isolates every digit before the GPT-2 split."""
    from tokenizers import normalizers, pre_tokenizers

    model = field(reader, "tokenizer.ggml.model")
    backend = tok.backend_tokenizer
    if model == "llama" and field(reader, "tokenizer.ggml.add_space_prefix", True):
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                   normalizers.Replace(" ", "\u2581")])
        backend.pre_tokenizer = None
    elif model == "gpt2" and field(reader, "tokenizer.ggml.pre") == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])


def eos_token_ids(tokenizer, model_path: str) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = generation_config(model_path)
    eos = gen.get("eos_token_id")
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(int(e) for e in eos)
    return frozenset(ids)


def generation_config(model_path: str) -> dict[str, Any]:
    p = Path(model_path) / "generation_config.json"
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        return {}


def default_sampling_params(model_path: str):
    """Defaults from the checkpoint's generation_config.json, like vLLM's ``--generation-config auto``."""
    from openinfer.sampling_params import SamplingParams

    gen = generation_config(model_path)
    kw: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if gen.get(key) is not None:
            kw[key] = gen[key]
    if gen.get("do_sample") is False:
        kw["temperature"] = 0.0
    return SamplingParams(**kw)


TOKENIZER_MODES = ("auto", "deepseek_v4", "deepseek_v32")


class PromptTooLong(ValueError):
    """The rendered prompt has more characters than the caller's bound: refused before tokenizing it."""

    def __init__(self, num_chars: int, max_chars: int) -> None:
        super().__init__(f"the prompt has {num_chars} characters, more than the limit of {max_chars}")
        self.num_chars = num_chars


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        chat_template: str | None = None, tokenizer_mode: str = "auto",
                        max_chars: int | None = None, **kwargs: Any) -> list[int]:
    """The conversation's prompt ids. With ``max_chars``, a rendered prompt longer than that (tools, template
    kwargs and all) raises ``PromptTooLong`` instead of being tokenized."""
    if not messages:
        raise ValueError("messages must be a non-empty list")
    if tokenizer_mode in ("deepseek_v4", "deepseek_v32"):
        text = _deepseek_prompt(tokenizer_mode, messages, **kwargs)
    else:
        if not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise ValueError("this tokenizer has no chat template; pass chat_template=")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **kwargs)
    if max_chars is not None and len(text) > max_chars:
        raise PromptTooLong(len(text), max_chars)
    # The template already wrote any BOS it wants (and DeepSeek's encoders theirs).
    return tokenizer.encode(text, add_special_tokens=False)


def _deepseek_prompt(mode: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                     thinking: bool = False, reasoning_effort: str | None = None, **_: Any) -> str:
    """DeepSeek-V4 and V3.2 ship a Python encoder, not a Jinja template. Tools ride on the system message (one is added
    when there is none); ``thinking`` (chat_template_kwargs, as DeepSeek's API names it) picks thinking mode.
    The encoder always ends with the assistant's turn opened: there is no add_generation_prompt=False form."""
    from openinfer.chat_encoding import deepseek_v4, deepseek_v32

    msgs = [dict(m) for m in messages]
    if tools:
        if not msgs or msgs[0].get("role") != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        msgs[0]["tools"] = tools
    mode_kw = {"thinking_mode": "thinking" if thinking else "chat"}
    if mode == "deepseek_v32":
        return deepseek_v32.encode_messages(msgs, **mode_kw)
    return deepseek_v4.encode_messages(msgs, reasoning_effort=reasoning_effort, **mode_kw)
