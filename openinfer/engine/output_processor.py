"""Turns per-step engine-core outputs into ``RequestOutput`` objects: detokenize, stop strings, logprobs,
and the fan-in of ``n > 1`` children into one output. Loops over the step's outputs once."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from openinfer.engine.detokenizer import IncrementalDetokenizer
from openinfer.engine.request import Request
from openinfer.engine.scheduler import EngineCoreOutput
from openinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from openinfer.sampling_params import SamplingParams


@dataclass
class ChildState:
    index: int
    request: Request
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[ChildState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None
    final_only: bool = False  # build a RequestOutput only when finished (offline use: no per-step copies)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, ChildState]] = {}

    def add(self, request_id: str, prompt: str | None, children: list[Request], params: SamplingParams,
            final_only: bool = False) -> None:
        states = []
        for i, req in enumerate(children):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens,
                                               params.stop, params.include_stop_str_in_output)
            states.append(ChildState(i, req, detok, logprobs=[] if params.logprobs is not None else None,
                                     cumulative_logprob=0.0 if params.logprobs is not None else None))
        parent = ParentState(request_id, prompt, children[0].prompt_token_ids, params, states,
                             RequestMetrics(arrival_time=children[0].times.arrival_s),
                             [None] if params.prompt_logprobs is not None else None, final_only)
        self.parents[request_id] = parent
        for c in states:
            self.child_to_parent[c.request.request_id] = (parent, c)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs for the parents touched this step, child ids that hit a stop string and must be
        finished in the scheduler)."""
        touched: dict[str, ParentState] = {}
        to_stop: list[str] = []
        for o in outputs:
            entry = self.child_to_parent.get(o.request_id)
            if entry is None:
                continue
            parent, child = entry
            touched[parent.request_id] = parent
            if o.new_prompt_logprobs and child.index == 0 and parent.prompt_logprobs is not None:
                parent.prompt_logprobs.extend(o.new_prompt_logprobs)
            if o.new_token_ids:
                child.token_ids.extend(o.new_token_ids)
                if child.logprobs is not None and o.new_logprobs:
                    child.logprobs.extend(o.new_logprobs)
                    for tok, lp in zip(o.new_token_ids, o.new_logprobs):
                        child.cumulative_logprob += lp[tok]
                if child.detok is not None:
                    hit = child.detok.add(o.new_token_ids)
                    if hit is not None and o.finish_reason is None:
                        child.finish_reason, child.stop_reason = "stop", hit
                        to_stop.append(o.request_id)
            if o.finish_reason is not None and child.finish_reason is None:
                child.finish_reason, child.stop_reason = o.finish_reason, o.stop_reason
        results = [self._make_output(p) for p in touched.values() if p.finished or not p.final_only]
        for p in touched.values():
            if p.finished:
                self._drop(p)
        return results, to_stop

    def finish_externally(self, child_id: str, reason: str) -> RequestOutput | None:
        """Mark a child finished by something outside the step (abort, engine error)."""
        entry = self.child_to_parent.get(child_id)
        if entry is None:
            return None
        parent, child = entry
        if child.finish_reason is None:
            child.finish_reason = reason
        out = self._make_output(parent)
        if parent.finished:
            self._drop(parent)
        return out

    def child_ids(self, request_id: str) -> list[str]:
        p = self.parents.get(request_id)
        return [c.request.request_id for c in p.children] if p else []

    def _drop(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for c in parent.children:
            self.child_to_parent.pop(c.request.request_id, None)

    def _make_output(self, p: ParentState) -> RequestOutput:
        outs = []
        for c in p.children:
            done = c.finish_reason is not None
            text = c.detok.visible_text(done) if c.detok is not None else ""
            outs.append(CompletionOutput(c.index, text, list(c.token_ids), c.cumulative_logprob,
                                         list(c.logprobs) if c.logprobs is not None else None,
                                         c.finish_reason, c.stop_reason))
        first = p.children[0].request
        times = [c.request.times for c in p.children]
        m = p.metrics
        m.first_scheduled_time = first.times.first_scheduled_s
        m.first_token_time = min((t.first_token_s for t in times if t.first_token_s), default=None)
        m.last_token_time = max((t.last_token_s for t in times if t.last_token_s), default=None)
        m.num_cached_tokens = max(first.num_cached_tokens, 0)
        m.num_preemptions = sum(c.request.num_preemptions for c in p.children)
        if p.finished:
            # Children stopped by a stop string are finished in the scheduler just after this step.
            m.finished_time = max(t.finished_s or time.monotonic() for t in times)
        return RequestOutput(p.request_id, p.prompt, p.prompt_token_ids, outs, p.finished,
                             list(p.prompt_logprobs) if p.prompt_logprobs is not None else None,
                             m.num_cached_tokens, m)
