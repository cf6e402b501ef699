"""Structured outputs: grammars (JSON schema, regex, choice, Lark / EBNF, structural tags) compiled by a backend
(llguidance, xgrammar) behind one seam, and the per-request matchers that turn a grammar into the token mask the
sampler applies. Pure Python above the backends: no tensors (the engine core and the scheduler use it)."""
