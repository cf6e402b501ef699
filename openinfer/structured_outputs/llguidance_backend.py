"""The llguidance backend (Microsoft's guidance engine, Rust; masks for a 32k vocabulary in tens of µs)."""
from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf

from openinfer.sampling_params import StructuredOutputsParams
from openinfer.structured_outputs.backend import CompiledGrammar, GrammarBackend, GrammarMatcher

# A JSON object of any shape (OpenAI's response_format json_object).
_ANY_OBJECT = {"type": "object"}
# JSON without free whitespace between tokens (llguidance's default allows any): what API users expect, and a
# weak model cannot spend its whole budget on newlines. A schema may still ask for it ("x-guidance").
_JSON_DEFAULTS = {"whitespace_flexible": False}


class _TokenTable:
    """What ``llguidance.TokenizerWrapper`` reads, for tokenizers llguidance cannot take whole (it reads HF
    byte-level and sentencepiece fast tokenizers, not e.g. a WordLevel one with a Fuse decoder): each id's bytes
    from decoding it alone; special tokens (and ids the tokenizer lacks) marked by llguidance's 0xFF prefix."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        special = set(tokenizer.all_special_ids)
        self.special_token_ids = sorted(t for t in special if t < vocab_size)
        n = len(tokenizer)
        tokens = []
        for i in range(vocab_size):
            name = tokenizer.convert_ids_to_tokens(i) if i < n else None
            if i in special or name is None:
                tokens.append(b"\xff" + (name or f"<unused_{i}>").encode())
            else:
                tokens.append(tokenizer.decode([i]).encode())
        self.tokens = tokens
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    eos = list(eos_token_ids) or None
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    except ValueError:  # "can't determine decoder type": build the token table ourselves
        table = _TokenTable(tokenizer, vocab_size, eos_token_ids)
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(table), n_vocab=vocab_size, eos_token=eos)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for one spec; ValueError naming the field when it cannot be built."""
    kind = spec.kind
    try:
        if kind == "json":
            schema = spec.json if isinstance(spec.json, dict) else json.loads(spec.json)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(spec.choice))
        if kind == "grammar":
            # Lark as llguidance reads it; EBNF / GBNF (``root ::= ...``) converted to Lark first.
            fmt = "ebnf" if "::=" in spec.grammar else "lark"
            return llguidance.grammar_from(fmt, spec.grammar)
        tag = spec.structural_tag if isinstance(spec.structural_tag, dict) else json.loads(spec.structural_tag)
        return json.dumps(tag) if "grammars" in tag else _structural_tag(tag)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind} is invalid: {e}") from None


def _structural_tag(tag: dict) -> str:
    """vLLM's structural tag ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``: free text in
    which each ``begin`` is followed by JSON valid against its schema and then ``end``."""
    structures = tag.get("structures")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag needs a non-empty 'structures' list")
    rules, alts = [], []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise ValueError(f"structures[{i}] needs string 'begin' and 'end'")
        rules.append(f"tag_{i}: {json.dumps(s['begin'])} json_{i} {json.dumps(s['end'])}")
        rules.append(f"json_{i}: %json {json.dumps(s.get('schema', {}))}")
        alts.append(f"tag_{i}")
    lark = "start: (text (" + " | ".join(alts) + "))* text\ntext: /(.|\\n)*/\n" + "\n".join(rules)
    return llguidance.LLMatcher.grammar_from_lark(lark)


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._m.consume_token(token_id)

    def validate_tokens(self, token_ids: list[int]) -> int:
        return self._m.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def bitmask(self) -> bytes:
        return self._m.compute_bitmask()

    @property
    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


class LLGuidanceGrammar(CompiledGrammar):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._template = matcher  # never advanced: each request starts from a copy

    def new_matcher(self) -> GrammarMatcher:
        return LLGuidanceMatcher(self._template.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        self.tokenizer = ll_tokenizer(tokenizer, vocab_size, sorted(eos_token_ids))

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        text = grammar_text(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} is invalid: {matcher.get_error().strip()}")
        return LLGuidanceGrammar(matcher)
