"""The xgrammar backend: an optional extra (``pip install 'openinfer[xgrammar]'``; xgrammar pulls triton, ~1 GB).

The test command installs it without its dependencies (triton is only needed for GPU masks) and the structured
outputs tests run on both backends; the llguidance backend is the default. xgrammar fills masks into its own (torch) tensors; this plugin never imports torch itself - the bytes it returns are what the engine
sees, as with llguidance."""
from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from openinfer.sampling_params import StructuredOutputsParams
from openinfer.structured_outputs.backend import CompiledGrammar, GrammarBackend, GrammarMatcher

try:
    import xgrammar as xgr
except ImportError:  # the seam reports it where the backend is chosen
    xgr = None

MAX_ROLLBACK_TOKENS = 64  # at least the most speculative tokens one step verifies
_COMPACT = (",", ":")  # JSON item and key separators, no spaces (json.dumps(separators=...))


class _NoControlChars:
    """Tokens whose text holds a raw control character (U+0000-U+001F). xgrammar's JSON string rule admits them
    (its string characters are `[^"\\\r\n]`: a raw tab passes), but strict JSON forbids them inside strings and
    compact JSON has no whitespace between tokens, so in compact JSON no such token is ever valid: the JSON
    grammars take them out of every mask and refuse them as drafts."""

    def __init__(self, info: Any) -> None:
        self.ids = frozenset(i for i, b in enumerate(info.decoded_vocab) if any(c < 0x20 for c in b))
        words = np.full(xgr.allocate_token_bitmask(1, info.vocab_size).shape[1], 0xFFFFFFFF, dtype=np.uint32)
        for i in self.ids:
            words[i // 32] &= np.uint32(~(1 << (i % 32)) & 0xFFFFFFFF)
        self.allowed = xgr.allocate_token_bitmask(1, info.vocab_size)[0]  # xgrammar's tensor
        self.allowed.numpy()[:] = words.view(np.int32)  # int32 words, shared memory


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, compiled: Any, vocab_size: int, forbid: _NoControlChars | None) -> None:
        self._m = xgr.GrammarMatcher(compiled, max_rollback_tokens=MAX_ROLLBACK_TOKENS)
        self._mask = xgr.allocate_token_bitmask(1, vocab_size)
        self._forbid = forbid

    def accept_token(self, token_id: int) -> bool:
        if self._forbid is not None and token_id in self._forbid.ids:
            return False
        return bool(self._m.accept_token(token_id))

    def validate_tokens(self, token_ids: list[int]) -> int:
        n = 0
        for t in token_ids:
            if not self.accept_token(t):
                break
            n += 1
        self.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def bitmask(self) -> bytes:
        self._m.fill_next_token_bitmask(self._mask, 0)
        if self._forbid is not None:
            self._mask[0] &= self._forbid.allowed
        return self._mask[0].numpy().tobytes()

    @property
    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XGrammarGrammar(CompiledGrammar):
    def __init__(self, compiled: Any, vocab_size: int, forbid: _NoControlChars | None = None) -> None:
        self._compiled = compiled
        self._vocab_size = vocab_size
        self._forbid = forbid

    def new_matcher(self) -> GrammarMatcher:
        return XGrammarMatcher(self._compiled, self._vocab_size, self._forbid)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        if xgr is None:
            raise ValueError("structured_outputs_backend='xgrammar' needs the xgrammar package: "
                             "pip install 'openinfer[xgrammar]' (or use the default, llguidance)")
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info)
        self._no_control_chars = _NoControlChars(info)

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        kind = spec.kind
        c = self._compiler
        try:
            # Compact JSON, as llguidance writes it: xgrammar's default (any_whitespace) lets a model that is
            # unsure emit whitespace until max_tokens, and without any_whitespace its separators are still
            # json.dumps' ", " and ": " (up to ~1.3x the tokens of the compact form); raw control characters, which
            # its string rule still admits, are masked out (_NoControlChars).
            if kind == "json":
                compiled = c.compile_json_schema(spec.json if isinstance(spec.json, str) else json.dumps(spec.json),
                                                 any_whitespace=False, separators=_COMPACT)
            elif kind == "json_object":
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=_COMPACT)
            elif kind == "regex":
                compiled = c.compile_regex(spec.regex)
            elif kind == "choice":
                compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))
            elif kind == "grammar":
                if "::=" not in spec.grammar:  # llguidance's test too: EBNF rules are `name ::= ...`
                    raise ValueError("structured_outputs.grammar looks like Lark (no `::=` rules); the xgrammar "
                                     "backend takes EBNF / GBNF (`root ::= ...`): rewrite it, or serve with "
                                     "--structured-outputs-backend llguidance, which takes both")
                compiled = c.compile_grammar(spec.grammar)
            else:
                tag = spec.structural_tag if isinstance(spec.structural_tag, str) else json.dumps(spec.structural_tag)
                compiled = c.compile_structural_tag(tag)
        except ValueError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError for bad grammars, prefixed "[time] file.cc:line: "
            why = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e)).strip()
            raise ValueError(f"structured_outputs.{kind} is invalid: {why}") from None
        return XGrammarGrammar(compiled, self.vocab_size,
                               self._no_control_chars if kind in ("json", "json_object") else None)
