"""Speculative decoding counters, under vLLM's metric names: drafts, draft tokens, accepted tokens, and acceptance
per draft position; where the proposer predicts acceptance (DSpark's confidence head), the predicted acceptance
summed per draft position beside it, so its calibration can be read against the measured rate. Pure Python."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verifications (requests x steps that carried drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose position i was accepted
    # [i]: sum of the predicted acceptance of verified drafts' position i, and how many drafts had one there
    confidence_per_pos: list[float] = field(default_factory=list)
    confidence_count_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int, confidence: list[float] | None = None) -> None:
        for i, c in enumerate((confidence or [])[:num_drafts]):
            if len(self.confidence_per_pos) <= i:
                self.confidence_per_pos.append(0.0)
                self.confidence_count_per_pos.append(0)
            self.confidence_per_pos[i] += c
            self.confidence_count_per_pos[i] += 1
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos += [0] * (num_drafts - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification: the accepted drafts plus the one sampled after them (1.0 without drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def mean_confidence_per_pos(self) -> list[float]:
        """Mean predicted acceptance of the verified drafts at each position (empty without a predictor)."""
        return [s / n for s, n in zip(self.confidence_per_pos, self.confidence_count_per_pos)]

    def merge(self, other: SpecDecodeStats) -> SpecDecodeStats:
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda v, w=width: v + [0] * (w - len(v))  # noqa: E731
        cw = max(len(self.confidence_per_pos), len(other.confidence_per_pos))
        add = lambda a, b: [x + y for x, y in zip(pad(a, cw), pad(b, cw))]  # noqa: E731
        return SpecDecodeStats(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                               self.num_accepted_tokens + other.num_accepted_tokens,
                               [a + b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))],
                               add(self.confidence_per_pos, other.confidence_per_pos),
                               add(self.confidence_count_per_pos, other.confidence_count_per_pos))
