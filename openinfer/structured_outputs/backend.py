"""The seam grammar backends plug into. A backend compiles a ``StructuredOutputsParams`` into a
``CompiledGrammar`` (shared, cached); each request gets its own ``GrammarMatcher`` from it.

Masks cross the engine -> worker wire as bytes: one bit per token id, 32-bit little-endian words, a row per
sampling position (llguidance's and xgrammar's layout), so the scheduler side never holds a tensor."""
from __future__ import annotations

import abc
from typing import Any

from openinfer.sampling_params import StructuredOutputsParams

BACKENDS = ("auto", "llguidance", "xgrammar")
# A grammar's source text beyond this is refused before compiling (a 400 naming the field): compile time and
# memory grow with it, and the engine must not be stalled by one request.
MAX_GRAMMAR_CHARS = 64 * 1024


class GrammarMatcher(abc.ABC):
    """One request's position in its grammar."""

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and the matcher is unusable) if the grammar forbids it."""

    @abc.abstractmethod
    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, in order, the grammar would accept from here (nothing is advanced)."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abc.abstractmethod
    def bitmask(self) -> bytes:
        """The tokens allowed next, one bit each (at least vocab_size bits; a backend may pad the row)."""

    @property
    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (EOS aside)."""


class CompiledGrammar(abc.ABC):
    @abc.abstractmethod
    def new_matcher(self) -> GrammarMatcher: ...


class GrammarBackend(abc.ABC):
    name: str

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    @abc.abstractmethod
    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Raises ValueError naming the field (``structured_outputs.json`` ...) for a grammar it cannot use."""


def check_size(spec: StructuredOutputsParams) -> None:
    kind, text = spec.key()
    if text is not None and len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"structured_outputs.{kind} is too large: {len(text)} characters (at most "
                         f"{MAX_GRAMMAR_CHARS})")


def make_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> GrammarBackend:
    """``auto`` is llguidance (a main dependency); xgrammar is an optional extra."""
    if name not in BACKENDS:
        raise ValueError(f"structured_outputs_backend={name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "xgrammar":
        from openinfer.structured_outputs.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, eos_token_ids)
    from openinfer.structured_outputs.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)
