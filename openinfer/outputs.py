"""What the engine returns, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per generated position: token id -> logprob
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Disaggregated prefill/decode: where this request's KV waits for a remote decoder (vLLM's field).
    kv_transfer_params: dict | None = None

    def __repr__(self) -> str:
        outs = ", ".join(repr(o.text[:40]) for o in self.outputs)
        return f"RequestOutput({self.request_id!r}, finished={self.finished}, outputs=[{outs}])"
