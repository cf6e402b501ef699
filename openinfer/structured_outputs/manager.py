"""Compiling off the engine loop, and each request's matcher.

``GrammarCompiler`` compiles on its own threads (llguidance drops the GIL while it builds a grammar) and keeps
the compiled grammars in an LRU cache keyed by the spec, so the API layer can validate a request (a 400 before
admission), and the engine core later finds the grammar ready. A request whose grammar is still compiling stays
in the waiting queue without holding anything back: the scheduler admits the requests behind it.

``RequestGrammar`` is one request's matcher, on the engine-core side next to the scheduler (which knows what was
accepted): it fills the mask rows of a step - one per sampling position, the drafts of speculative decoding
accepted tentatively and rolled back afterwards - and advances on the tokens the step emitted. The workers only
apply masks, so every tensor-parallel rank and data-parallel replica sees the same ones.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from openinfer.sampling_params import StructuredOutputsParams
from openinfer.structured_outputs.backend import CompiledGrammar, GrammarBackend, GrammarMatcher, check_size

logger = logging.getLogger(__name__)

CACHE_SIZE = 256


class GrammarCompiler:
    def __init__(self, backend: GrammarBackend, max_workers: int = 2, cache_size: int = CACHE_SIZE) -> None:
        self.backend = backend
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str | None], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def submit(self, spec: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar, or the compile under way (a failed one holds its ValueError). Thread-safe."""
        check_size(spec)
        key = spec.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        grammar = self.backend.compile(spec)
        # A grammar no token of this vocabulary can start (a choice of characters the tokenizer cannot spell) is
        # the request's mistake: refused here (a 400), not found out by the sampler mid-step (an engine error).
        if not _can_start(grammar.new_matcher()):
            raise ValueError(f"structured_outputs.{spec.kind} allows no token of this model's vocabulary at its "
                             f"start (can the tokenizer spell it?)")
        self.num_compiled += 1
        return grammar

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Blocking; raises ValueError naming the field for a grammar that cannot be used."""
        return self.submit(spec).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _can_start(matcher: GrammarMatcher) -> bool:
    """Whether some token the first mask allows is also accepted (a backend's mask may let through a token it
    then refuses, e.g. one the tokenizer marks unknown). Normally the first allowed token already is."""
    words = memoryview(matcher.bitmask()).cast("I")
    for w, word in enumerate(words):
        while word:
            bit = word & -word
            if matcher.validate_tokens([w * 32 + bit.bit_length() - 1]) == 1:
                return True
            word ^= bit
    return False


class RequestGrammar:
    """One request's grammar state. ``ready`` once compiled; ``error`` when compiling failed."""

    def __init__(self, compiled: Future[CompiledGrammar]) -> None:
        self._compiled = compiled
        self._matcher: GrammarMatcher | None = None
        self.error: str | None = None

    @property
    def ready(self) -> bool:
        if self._matcher is None and self.error is None and self._compiled.done():
            try:
                self._matcher = self._compiled.result().new_matcher()
            except Exception as e:  # noqa: BLE001 - any failure ends the request with its message
                self.error = str(e)
        return self._matcher is not None

    @property
    def matcher(self) -> GrammarMatcher:
        assert self._matcher is not None, "grammar not compiled yet"
        return self._matcher

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the grammar rejects: verifying past it cannot yield an output."""
        return drafts[:self.matcher.validate_tokens(drafts)] if drafts else drafts

    def step_bitmask(self, drafts: list[int]) -> bytes:
        """Mask rows for the step's k + 1 sampling positions: after the known tokens, and after each draft."""
        m = self.matcher
        rows = [m.bitmask()]
        for d in drafts:
            if not m.accept_token(d):  # valid_drafts() checked them; a failure here is a backend fault
                raise RuntimeError(f"grammar rejected draft token {d} it had validated")
            rows.append(m.bitmask())
        m.rollback(len(drafts))  # the step's outcome decides which drafts stay (accept())
        return b"".join(rows)

    def accept(self, token_id: int) -> bool:
        ok = self.matcher.accept_token(token_id)
        if not ok:
            logger.warning("grammar rejected sampled token %d", token_id)
        return ok

    @property
    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated
