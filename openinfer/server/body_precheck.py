"""The checks a large request body gets before it is decoded: the caps on list fields, the prompt's length in
token ids or characters, the conversation's characters, the number of prompts. They read the raw body
(``raw_json.py``), so a body refused here costs the server no memory beyond the body itself; what passes is decoded
and validated in full afterwards, where every check runs again on the decoded values (these are a cheaper first
copy of the same rules, made by the same functions of request_validation.py, so with the same messages)."""
from __future__ import annotations

from typing import Protocol

import msgspec

from openinfer.server.errors import APIError
from openinfer.server.raw_json import container_items, decode_or_none, number_items, string_chars


class Limits(Protocol):
    """The checks of ``request_validation.RequestValidator`` that these call."""

    max_model_len: int
    max_prompt_chars: int

    def too_long(self, what: str, param: str) -> APIError: ...

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None: ...

    def check_num_sequences(self, num_prompts: int, n: int) -> None: ...

    def check_list_counts(self, **counts: int) -> None: ...


# The list fields with caps, by their name in each API (Anthropic's messages API names its stop strings
# stop_sequences).
_CAPPED = {"stop": "stop", "stop_sequences": "stop", "stop_token_ids": "stop_token_ids", "logit_bias": "logit_bias",
           "allowed_token_ids": "allowed_token_ids", "bad_words": "bad_words"}


def precheck(ctx: Limits, top: dict[str, msgspec.Raw], anthropic: bool = False) -> None:
    """Raise the ``APIError`` the full validation would raise for an over-long or over-sized field. ``anthropic``:
    the body is a /v1/messages one (its ``system`` text joins the conversation)."""
    ctx.check_list_counts(**{cap: container_items(top[name]) or 0 for name, cap in _CAPPED.items() if name in top})
    if "prompt" in top:
        _check_prompt(ctx, top["prompt"], top.get("n"))
    if "messages" in top:
        system = top.get("system") if anthropic else None
        _check_messages(ctx, top["messages"], (string_chars(system) or 0) if system is not None else 0)


def _check_ids_or_text(ctx: Limits, raw: msgspec.Raw) -> bool:
    """Check one prompt given as a text or as token ids; False when ``raw`` is neither."""
    ids = number_items(raw)
    if ids is not None:
        if ids >= ctx.max_model_len:
            raise ctx.too_long(f"your request has {ids} input tokens", "prompt")
        return True
    chars = string_chars(raw)
    if chars is not None:
        ctx.check_prompt_chars(chars, "prompt")
        return True
    return False


def _check_prompt(ctx: Limits, raw: msgspec.Raw, n_raw: msgspec.Raw | None) -> None:
    if _check_ids_or_text(ctx, raw):
        return
    num_prompts = container_items(raw)
    if not num_prompts:
        return
    n = decode_or_none(n_raw, int) if n_raw is not None else 1
    ctx.check_num_sequences(num_prompts, n if isinstance(n, int) and n >= 1 else 1)
    for item in decode_or_none(raw, list[msgspec.Raw]) or ():  # at most the server's capacity of prompts
        _check_ids_or_text(ctx, item)


def _check_messages(ctx: Limits, raw: msgspec.Raw, chars: int) -> None:
    """The characters of the messages' text contents, as the chat path counts them after decoding."""
    count = container_items(raw)
    if count is None:
        return
    if count > ctx.max_prompt_chars:
        # Every message renders to at least its role marker, so this many cannot fit; refused before one small
        # object per message is built (~400 B each for ~30 B of JSON).
        raise ctx.too_long(f"your request has {count} messages, more than the {ctx.max_prompt_chars} characters "
                           f"that {ctx.max_model_len} tokens can hold", "messages")
    for message in decode_or_none(raw, list[dict[str, msgspec.Raw]]) or ():
        content = message.get("content")
        chars += (string_chars(content) or 0) if content is not None else 0
    ctx.check_prompt_chars(chars, "messages")
