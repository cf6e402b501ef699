"""Typed messages between the event loop (API side) and the engine-core thread.

Every message is a ``msgspec.Struct`` with a fixed schema: today they cross a thread boundary by reference,
but the same types encode to msgpack/JSON unchanged if the core moves to its own process (never pickle).
Outputs carry *diffs* (new text, new token ids, new logprobs), not the cumulative state, so each message stays
small however long a generation gets.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from openinfer.sampling_params import SamplingParams

# -- loop -> engine ------------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    arrival_s: float | None = None  # time.monotonic() at HTTP arrival (TTFT counts from here); None = now


class AbortRequests(msgspec.Struct, tag=True, frozen=True):
    request_ids: list[str]


class Control(msgspec.Struct, tag=True, frozen=True):
    control_id: int
    op: Literal["reset_prefix_cache"]


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    pass


EngineCommand = AddRequest | AbortRequests | Control | Shutdown

# -- engine -> loop ------------------------------------------------------------------------------


class CompletionDelta(msgspec.Struct, frozen=True):
    """What one choice gained since the last message."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None  # one dict per new token: token id -> logprob
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None


class RequestUpdate(msgspec.Struct, tag=True, frozen=True):
    """The first message for a request is either ``accepted`` or a finished one with ``error`` set; after that
    come deltas until one has ``finished``."""

    request_id: str
    outputs: list[CompletionDelta] = []
    finished: bool = False
    accepted: bool = False
    error: str | None = None
    # invalid = the client's input (HTTP 400); timeout = it outran --request-timeout-s (HTTP 504)
    error_kind: Literal["invalid", "engine", "timeout"] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # sent once, with the first output


class ControlReply(msgspec.Struct, tag=True, frozen=True):
    control_id: int
    ok: bool
    value: int | str | None = None


class StatsSnapshot(msgspec.Struct, frozen=True):
    """Engine state published by the core thread after every loop iteration (read by /metrics, /health)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    heartbeat_s: float = 0.0  # time.monotonic() of the core loop's last iteration
    step_started_s: float | None = None  # set while a step runs: lets /health/ready spot a stalled step
    eplb_rebalances: int = 0
    eplb_imbalance_served: float = 1.0
    eplb_imbalance_rebalanced: float = 1.0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    consecutive_failed_steps: int = 0  # steps in a row whose forward failed: /health/ready turns 503 past a bound


class EngineDead(msgspec.Struct, tag=True, frozen=True):
    """The core thread failed; every open request ends with this reason and new ones are refused."""

    reason: str


EngineEvent = RequestUpdate | ControlReply | EngineDead
