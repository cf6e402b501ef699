"""A request's life inside the engine core. Pure Python: no tensors here."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from openinfer.sampling_params import SamplingParams
from openinfer.step_io import MMImage

if TYPE_CHECKING:
    from openinfer.structured_outputs.manager import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Admitted with blocks allocated, its prompt's KV being read from another instance (disaggregated decode).
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


# A request that ends with an error its own input caused (not a fault of the engine) says so in its stop_reason,
# which starts with this; the server answers it with a 400 rather than a 500.
INVALID_REQUEST = "invalid request: "

_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


def check_priority(priority: object, policy: str) -> None:
    """vLLM's rule: a request may carry a priority other than 0 only when the engine schedules by priority."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not -(1 << 63) <= priority < (1 << 63):
        raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"priority={priority} needs the priority scheduling policy (--scheduling-policy priority "
                         f"/ scheduling_policy='priority'); this engine schedules {policy}")


@dataclass
class RequestTimes:
    arrival_s: float = field(default_factory=time.monotonic)
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None


class Request:
    """Token state of one sequence. The invariant the scheduler keeps: ``num_computed_tokens`` catches up to
    ``num_tokens``; when it does, the model samples one more token (prefill and decode are the same rule)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_model_len: int,
        arrival_s: float | None = None,
        priority: int = 0,
        mm_images: list[MMImage] | None = None,
    ) -> None:
        self.request_id = request_id
        # vLLM's request priority: under the "priority" scheduling policy a lower value is served first.
        self.priority = priority
        self.arrival_order = 0  # the scheduler's intake count: breaks ties between equal arrival times
        self.max_model_len = max_model_len
        self.prompt_token_ids = list(prompt_token_ids)
        # The prompt's images (positions and pixels); their content hashes key the prefix cache (block_salts).
        self.mm_images: list[MMImage] = list(mm_images or [])
        self.sampling_params = sampling_params
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache the first time this request was scheduled.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []  # chain hashes of full blocks, filled lazily by the KV manager
        # Speculative decoding: drafts proposed after the last step, verified by the next one. Never part of the
        # token list (nor hashed) until accepted.
        self.spec_token_ids: list[int] = []
        self.spec_confidence: list[float] = []  # the proposer's predicted acceptance of each, when it makes one
        # Structured outputs: the matcher (compiled off the loop; the request waits until it is ready).
        self.grammar: RequestGrammar | None = None
        # Disaggregated prefill/decode: what the KV connector returns when this request ends (producer side).
        self.kv_transfer_params: dict | None = None
        self.times = RequestTimes()
        if arrival_s is not None:
            self.times.arrival_s = arrival_s
        budget = max_model_len - len(self.prompt_token_ids)
        sp_max = sampling_params.max_tokens
        self.max_tokens = budget if sp_max is None else min(sp_max, budget)

    def block_salt(self, start: int, end: int) -> tuple[str, ...]:
        """Content hashes of the images overlapping token positions [start, end): part of a cached block's key,
        so a block of image positions is only ever shared by requests with the same image there (vLLM's mm
        hashes)."""
        return tuple(m.content_hash for m in self.mm_images if m.offset < end and start < m.offset + m.length)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
