"""Turns the engine core's per-step deltas into ``RequestOutput`` objects: detokenize, stop strings, logprobs,
metrics, and the fan-in of ``n > 1`` children into one output. Loops over the step's outputs once and reads
nothing but those outputs.

What each ``RequestOutput`` carries follows the request's ``output_kind``: DELTA (what is new since the previous
output: streaming, no per-step copies of whole token lists), CUMULATIVE (everything so far), FINAL_ONLY (one
output, when it finishes).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from openinfer.engine.core_io import EngineCoreOutput
from openinfer.engine.detokenizer import IncrementalDetokenizer
from openinfer.engine.parallel_sampling import ParentRequest
from openinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from openinfer.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

DELTA = RequestOutputKind.DELTA
FINAL_ONLY = RequestOutputKind.FINAL_ONLY


@dataclass
class ChildState:
    index: int
    detok: IncrementalDetokenizer | None
    keep_all: bool  # CUMULATIVE / FINAL_ONLY keep every token and logprob; DELTA only this step's
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    new_token_ids: list[int] = field(default_factory=list)  # DELTA: since the previous output
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_tokens: int = 0
    sent_text_len: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finish_sent: bool = False
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    num_preemptions: int = 0


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[ChildState]
    child_ids: list[str]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprobs_sent: bool = False
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, ChildState]] = {}

    def add(self, parent: ParentRequest, prompt: str | None, arrival_s: float) -> None:
        params = parent.params
        keep_all = params.output_kind != DELTA
        states = []
        for i, req in enumerate(parent.children):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens,
                                               params.stop, params.include_stop_str_in_output)
            want_lp = params.logprobs is not None
            states.append(ChildState(i, detok, keep_all, logprobs=[] if want_lp and keep_all else None,
                                     cumulative_logprob=0.0 if want_lp else None))
        state = ParentState(parent.request_id, prompt, parent.first.prompt_token_ids, params, states,
                            parent.child_ids(), RequestMetrics(arrival_time=arrival_s),
                            [None] if params.prompt_logprobs is not None else None)
        self.parents[parent.request_id] = state
        for req, c in zip(parent.children, states):
            self.child_to_parent[req.request_id] = (state, c)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str], list[str]]:
        """Returns (outputs for the parents touched this step, child ids that hit a stop string and must be
        finished in the engine core, child ids whose own processing failed - detokenizing, stop strings - and
        must be finished there with an error). A failure ends its own request only, never the others."""
        touched: dict[str, ParentState] = {}
        to_stop: list[str] = []
        to_fail: list[str] = []
        for o in outputs:
            try:
                self._process_one(o, touched, to_stop)
            except Exception:
                logger.exception("request %s: processing its output failed; ending it with an error", o.request_id)
                entry = self.child_to_parent.get(o.request_id)
                if entry is not None and entry[1].finish_reason is None:
                    entry[1].finish_reason, entry[1].finished_s = "error", o.timestamp_s
                    if o.finish_reason is None:
                        to_fail.append(o.request_id)
        results = []
        for p in touched.values():
            try:
                out = self._make_output(p)
            except Exception:
                logger.exception("request %s: building its output failed; ending it with an error", p.request_id)
                for cid, c in zip(p.child_ids, p.children):
                    if c.finish_reason is None:
                        c.finish_reason, c.finished_s = "error", time.monotonic()
                        to_fail.append(cid)
                    c.detok = None  # what broke is not asked again; the final output carries no more text
                out = self._make_output(p)
            if out is not None:
                results.append(out)
            if p.finished:
                self._drop(p)
        return results, to_stop, to_fail

    def _process_one(self, o: EngineCoreOutput, touched: dict[str, ParentState], to_stop: list[str]) -> None:
        entry = self.child_to_parent.get(o.request_id)
        if entry is None:
            return
        parent, child = entry
        touched[parent.request_id] = parent
        m = parent.metrics
        if child.index == 0:
            m.first_scheduled_time = o.first_scheduled_s
            m.num_cached_tokens = o.num_cached_tokens
            if o.new_prompt_logprobs and parent.prompt_logprobs is not None:
                parent.prompt_logprobs.extend(o.new_prompt_logprobs)
        child.num_preemptions = o.num_preemptions
        if o.new_token_ids:
            hit, taken = child.detok.add(o.new_token_ids) if child.detok is not None else (None, 0)
            if hit is not None:  # tokens after the stop string's are dropped (several per step: speculation)
                o.new_token_ids = o.new_token_ids[:taken]
                o.new_logprobs = o.new_logprobs[:taken] if o.new_logprobs else o.new_logprobs
            self._add_tokens(child, o)
            if hit is not None and child.finish_reason is None:
                # The stop string ended the text at a token no later than whatever finished the request.
                child.finish_reason, child.stop_reason = "stop", hit
                child.finished_s = o.timestamp_s
                if o.finish_reason is None:
                    to_stop.append(o.request_id)
        if o.kv_transfer_params is not None:
            parent.kv_transfer_params = o.kv_transfer_params
        if o.finish_reason is not None and child.finish_reason is None:
            child.finish_reason, child.stop_reason = o.finish_reason, o.stop_reason
            child.finished_s = o.timestamp_s

    @staticmethod
    def _add_tokens(child: ChildState, o: EngineCoreOutput) -> None:
        child.num_tokens += len(o.new_token_ids)
        (child.token_ids if child.keep_all else child.new_token_ids).extend(o.new_token_ids)
        if o.new_logprobs and child.cumulative_logprob is not None:
            (child.logprobs if child.keep_all else child.new_logprobs).extend(o.new_logprobs)
            for tok, lp in zip(o.new_token_ids, o.new_logprobs):
                child.cumulative_logprob += lp[tok]
        if child.first_token_s is None:
            child.first_token_s = o.timestamp_s
        child.last_token_s = o.timestamp_s

    def finish_externally(self, child_id: str, reason: str) -> RequestOutput | None:
        """Mark a child finished by something outside the step (abort, engine error); returns the parent's
        output if this finishes it."""
        entry = self.child_to_parent.get(child_id)
        if entry is None:
            return None
        parent, child = entry
        if child.finish_reason is None:
            child.finish_reason = reason
            child.finished_s = time.monotonic()
        out = self._make_output(parent) if parent.finished else None
        if parent.finished:
            self._drop(parent)
        return out

    def child_ids(self, request_id: str) -> list[str]:
        p = self.parents.get(request_id)
        return list(p.child_ids) if p is not None else []

    def _drop(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for cid in parent.child_ids:
            self.child_to_parent.pop(cid, None)

    def _make_output(self, p: ParentState) -> RequestOutput | None:
        kind = p.params.output_kind
        finished = p.finished
        if kind == FINAL_ONLY and not finished:
            return None
        outs = []
        for c in p.children:
            done = c.finish_reason is not None
            text = c.detok.visible_text(done) if c.detok is not None else ""
            if kind == DELTA:
                if len(text) < c.sent_text_len:
                    # Visible text only grows (stop strings are held back before they show); never retract.
                    logger.warning("request %s: visible text shrank from %d to %d chars", p.request_id,
                                   c.sent_text_len, len(text))
                new_text = text[c.sent_text_len:]
                if not c.new_token_ids and not new_text and (not done or c.finish_sent):
                    continue
                outs.append(CompletionOutput(c.index, new_text, c.new_token_ids, c.cumulative_logprob,
                                             c.new_logprobs if c.cumulative_logprob is not None else None,
                                             c.finish_reason, c.stop_reason))
                c.sent_text_len = max(c.sent_text_len, len(text))
            else:
                outs.append(CompletionOutput(c.index, text, list(c.token_ids), c.cumulative_logprob,
                                             list(c.logprobs) if c.logprobs is not None else None,
                                             c.finish_reason, c.stop_reason))
            c.finish_sent = c.finish_sent or done
            c.new_token_ids, c.new_logprobs = [], []
        prompt_lps = None
        if p.prompt_logprobs is not None:
            if kind != DELTA:
                prompt_lps = list(p.prompt_logprobs)
            elif not p.prompt_logprobs_sent and (any(c.num_tokens for c in p.children) or finished):
                prompt_lps, p.prompt_logprobs_sent = p.prompt_logprobs, True  # once, when complete
        if kind == DELTA and not outs and prompt_lps is None and not finished:
            return None
        m = p.metrics
        m.first_token_time = min((c.first_token_s for c in p.children if c.first_token_s), default=None)
        m.last_token_time = max((c.last_token_s for c in p.children if c.last_token_s), default=None)
        m.num_preemptions = sum(c.num_preemptions for c in p.children)
        if finished:
            m.finished_time = max(c.finished_s or time.monotonic() for c in p.children)
        return RequestOutput(p.request_id, p.prompt, p.prompt_token_ids, outs, finished, prompt_lps,
                             m.num_cached_tokens, m, p.kv_transfer_params if finished else None)
