"""The scheduler's step shape and policy."""
from __future__ import annotations

from dataclasses import dataclass


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """The step's shape. ``max_model_len`` is not here: its one home is ``ModelConfig`` (each ``Request``
    receives it once and caps its ``max_tokens`` with it)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # KV slots allocated past each scheduled request's tokens: a drafting model writes its chain of drafts there.
    num_lookahead_tokens: int = 0
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority" (lower ``priority`` value first, ties by
    # arrival; preemption takes the lowest priority running request first).
    policy: str = "fcfs"
    # speculative_config.confidence_token_cost: the confidence head decides how many drafts are verified
    confidence_token_cost: float | None = None

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.policy!r}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
