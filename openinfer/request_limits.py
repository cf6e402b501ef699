"""Caps on how much one request may ask for, checked at the door (engine and server) so that no single request
can make the engine do unbounded work per token or per step: the number and length of stop strings, token-id
lists, bad words (a grammar's size is capped where it is compiled: ``structured_outputs/backend.py``). The
defaults are generous for real clients (OpenAI itself allows 4 stop strings and 300 logit_bias entries) and small
next to what would slow a batch down; a server can change them (``ServerSettings.limits``).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

# Every integer a request carries must fit a signed 64-bit int: tensors and msgpack (the worker wire) hold no more.
INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 128  # OpenAI's limit for n
    max_stop_strings: int = 64
    max_stop_chars: int = 256  # per stop string
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024  # entries
    max_bad_words: int = 128
    max_bad_word_chars: int = 256  # per word

    def __post_init__(self) -> None:
        for name, v in vars(self).items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"RequestLimits.{name} must be an integer >= 1, got {v!r}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """``--max-n``, ``--max-stop-strings``, ... (one flag per field, same default)."""
        g = parser.add_argument_group("request limits",
                                      "per-request caps; a request past one gets a 400 naming the field")
        for f in fields(cls):
            g.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default, metavar="N",
                           help=f"(default: {f.default})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RequestLimits:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


DEFAULT_LIMITS = RequestLimits()


def check_counts(vocab_size: int, limits: RequestLimits, *, n: int = 1, stop: int = 0, stop_token_ids: int = 0,
                 logit_bias: int = 0, allowed_token_ids: int = 0, bad_words: int = 0) -> None:
    """How many items each list field holds, against its cap: O(1), so the server checks it before any other work
    on the request (tokenizing it included). ValueError naming the field and the limit."""
    if n > limits.max_n:
        raise ValueError(f"n must be at most {limits.max_n}, got {n}")
    for name, count, cap in (("stop", stop, limits.max_stop_strings),
                             ("stop_token_ids", stop_token_ids, limits.max_stop_token_ids),
                             ("logit_bias", logit_bias, limits.max_logit_bias),
                             ("allowed_token_ids", allowed_token_ids, vocab_size),
                             ("bad_words", bad_words, limits.max_bad_words)):
        if count > cap:
            raise ValueError(f"{name} has {count} items, more than the limit of {cap}")
