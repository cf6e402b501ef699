"""Core-thread side of the bridge: the engine's cumulative ``RequestOutput``\\ s become diffs, and the
Prometheus counters and histograms are fed as tokens appear."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from openinfer.outputs import RequestOutput
from openinfer.server.messages import CompletionDelta, RequestUpdate
from openinfer.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


@dataclass
class _ChildState:
    sent_text_len: int = 0
    sent_tokens: int = 0
    finished: bool = False


@dataclass
class _TrackedRequest:
    arrival_s: float
    num_prompt_tokens: int
    children: dict[int, _ChildState] = field(default_factory=dict)
    first_token_seen: bool = False
    last_output_s: float = 0.0
    prompt_logprobs_sent: bool = False


class OutputTracker:
    """Turns the engine's cumulative ``RequestOutput``\\ s into diffs and feeds the metrics (core thread
    only)."""

    def __init__(self, metrics: ServerMetrics | None) -> None:
        self.metrics = metrics
        self.active: dict[str, _TrackedRequest] = {}

    def add(self, request_id: str, num_prompt_tokens: int, arrival_s: float) -> None:
        self.active[request_id] = _TrackedRequest(arrival_s, num_prompt_tokens)

    def update(self, out: RequestOutput, now: float) -> RequestUpdate | None:
        st = self.active.get(out.request_id)
        if st is None:
            return None
        deltas = []
        num_new = 0
        for c in out.outputs:
            cs = st.children.setdefault(c.index, _ChildState())
            if cs.finished:
                continue
            new_ids = c.token_ids[cs.sent_tokens :]
            text = c.text
            if len(text) < cs.sent_text_len:
                # Visible text only grows (stop strings are held back before they show); never retract.
                logger.warning(
                    "request %s: visible text shrank from %d to %d chars",
                    out.request_id,
                    cs.sent_text_len,
                    len(text),
                )
            new_text = text[cs.sent_text_len :]
            done = c.finish_reason is not None
            if not new_ids and not new_text and not done:
                continue
            lps = (
                c.logprobs[cs.sent_tokens : cs.sent_tokens + len(new_ids)] if c.logprobs is not None else None
            )
            deltas.append(
                CompletionDelta(c.index, new_text, list(new_ids), lps, c.finish_reason, c.stop_reason)
            )
            cs.sent_text_len = max(cs.sent_text_len, len(text))
            cs.sent_tokens += len(new_ids)
            cs.finished = done
            num_new += len(new_ids)
        prompt_lps = None
        if out.prompt_logprobs is not None and not st.prompt_logprobs_sent and (num_new or out.finished):
            prompt_lps = out.prompt_logprobs
            st.prompt_logprobs_sent = True
        if self.metrics is not None:
            self._observe(st, out, num_new, now)
        if out.finished:
            del self.active[out.request_id]
        if not deltas and not out.finished and prompt_lps is None:
            return None
        return RequestUpdate(
            out.request_id,
            deltas,
            finished=out.finished,
            num_prompt_tokens=st.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            prompt_logprobs=prompt_lps,
        )

    def _observe(self, st: _TrackedRequest, out: RequestOutput, num_new: int, now: float) -> None:
        m = self.metrics
        if num_new:
            if not st.first_token_seen:
                st.first_token_seen = True
                mt = out.metrics
                queue_s = (mt.first_scheduled_time - st.arrival_s) if mt and mt.first_scheduled_time else None
                m.on_first_token(st.num_prompt_tokens, now - st.arrival_s, queue_s)
                m.on_tokens(num_new, None)
            else:
                m.on_tokens(num_new, now - st.last_output_s)
            st.last_output_s = now
        if out.finished:
            reasons = [c.finish_reason for c in out.outputs]
            reason = next((r for r in ("error", "abort") if r in reasons), reasons[0] if reasons else "abort")
            m.on_finished(
                reason or "abort",
                now - st.arrival_s,
                st.num_prompt_tokens,
                sum(len(c.token_ids) for c in out.outputs),
            )
