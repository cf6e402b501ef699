"""The xgrammar backend: an optional extra (``pip install 'openinfer[xgrammar]'``; xgrammar pulls triton, ~1 GB).

Not covered by the test suite (the test extra does not install xgrammar); the llguidance backend is the default.
xgrammar fills masks into torch tensors, so this plugin imports torch - the bytes it returns are what the engine
sees, as with llguidance."""
from __future__ import annotations

import json
from typing import Any

from openinfer.sampling_params import StructuredOutputsParams
from openinfer.structured_outputs.backend import CompiledGrammar, GrammarBackend, GrammarMatcher

try:
    import xgrammar as xgr
except ImportError:  # the seam reports it where the backend is chosen
    xgr = None

MAX_ROLLBACK_TOKENS = 64  # at least the most speculative tokens one step verifies


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, compiled: Any, vocab_size: int) -> None:
        self._m = xgr.GrammarMatcher(compiled, max_rollback_tokens=MAX_ROLLBACK_TOKENS)
        self._mask = xgr.allocate_token_bitmask(1, vocab_size)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def validate_tokens(self, token_ids: list[int]) -> int:
        n = 0
        for t in token_ids:
            if not self._m.accept_token(t):
                break
            n += 1
        self.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def bitmask(self) -> bytes:
        self._m.fill_next_token_bitmask(self._mask, 0)
        return self._mask[0].numpy().tobytes()

    @property
    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XGrammarGrammar(CompiledGrammar):
    def __init__(self, compiled: Any, vocab_size: int) -> None:
        self._compiled = compiled
        self._vocab_size = vocab_size

    def new_matcher(self) -> GrammarMatcher:
        return XGrammarMatcher(self._compiled, self._vocab_size)


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

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        kind = spec.kind
        c = self._compiler
        try:
            if kind == "json":
                compiled = c.compile_json_schema(spec.json if isinstance(spec.json, str) else json.dumps(spec.json))
            elif kind == "json_object":
                compiled = c.compile_builtin_json_grammar()
            elif kind == "regex":
                compiled = c.compile_regex(spec.regex)
            elif kind == "choice":
                compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))
            elif kind == "grammar":
                compiled = c.compile_grammar(spec.grammar)
            else:
                tag = spec.structural_tag if isinstance(spec.structural_tag, str) else json.dumps(spec.structural_tag)
                compiled = c.compile_structural_tag(tag)
        except Exception as e:  # xgrammar raises RuntimeError for bad grammars
            raise ValueError(f"structured_outputs.{kind} is invalid: {e}") from None
        return XGrammarGrammar(compiled, self.vocab_size)
