"""Core-thread side of the bridge: the engine's DELTA ``RequestOutput``\\ s become ``RequestUpdate`` messages,
and the Prometheus counters and histograms are fed as tokens appear. The engine already sends only what is new,
so nothing here keeps or diffs whole token lists."""

from __future__ import annotations

from dataclasses import dataclass

from openinfer.outputs import RequestOutput
from openinfer.server.messages import CompletionDelta, RequestUpdate
from openinfer.server.metrics import ServerMetrics


@dataclass
class _TrackedRequest:
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int = 0
    first_token_seen: bool = False
    last_output_s: float = 0.0
    finish_reasons: dict[int, str] | None = None


class OutputTracker:
    def __init__(self, metrics: ServerMetrics | None) -> None:
        self.metrics = metrics
        self.active: dict[str, _TrackedRequest] = {}

    def add(self, request_id: str, num_prompt_tokens: int, arrival_s: float) -> None:
        self.active[request_id] = _TrackedRequest(arrival_s, num_prompt_tokens)

    def update(self, out: RequestOutput, now: float) -> RequestUpdate | None:
        st = self.active.get(out.request_id)
        if st is None:
            return None
        deltas = [CompletionDelta(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
                  for c in out.outputs]
        num_new = sum(len(c.token_ids) for c in out.outputs)
        st.num_output_tokens += num_new
        if st.finish_reasons is None:
            st.finish_reasons = {}
        st.finish_reasons.update({c.index: c.finish_reason for c in out.outputs if c.finish_reason})
        if self.metrics is not None:
            self._observe(st, out, num_new, now)
        if out.finished:
            del self.active[out.request_id]
        if not deltas and not out.finished and out.prompt_logprobs is None:
            return None
        return RequestUpdate(
            out.request_id,
            deltas,
            finished=out.finished,
            num_prompt_tokens=st.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            prompt_logprobs=out.prompt_logprobs,
            kv_transfer_params=out.kv_transfer_params,
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
            reasons = list(st.finish_reasons.values())
            reason = next((r for r in ("error", "abort") if r in reasons), reasons[0] if reasons else "abort")
            m.on_finished(reason, now - st.arrival_s, st.num_prompt_tokens, st.num_output_tokens)
