"""The worker's own copy of each running request, kept up to date from the scheduler's deltas, and the step's
inputs built from it (token ids, positions, per-group block tables in the forward context)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from openinfer.forward_context import AttentionMetadata
from openinfer.sampling_params import SamplingParams
from openinfer.step_io import MMImage, SchedulerOutput


class BlockIdMirror:
    """One request's block ids in one KV group as an int64 tensor, kept in step with the worker's list of them.
    The list only grows (``InputBatch.update`` extends it), so each step converts only the ids appended since the
    last one; a step's block table is then one row copy per request. Converting the whole list every step cost
    B x context / block_size Python ints per group (65k at batch 8 x 131,072 tokens, ~5 ms a group), the one
    per-step cost of a long-context decode step that grew with context outside the model."""

    __slots__ = ("ids", "buf", "n")

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.buf = torch.empty(max(16, len(ids)), dtype=torch.long)
        self.n = 0

    def tensor(self) -> torch.Tensor:
        n = len(self.ids)
        if n < self.n:  # not the append-only list this mirrors: start again
            self.n = 0
        if n > self.n:
            if n > self.buf.numel():
                grown = torch.empty(max(n, 2 * self.buf.numel()), dtype=torch.long)
                grown[:self.n] = self.buf[:self.n]
                self.buf = grown
            self.buf[self.n:n] = torch.tensor(self.ids[self.n:n], dtype=torch.long)
            self.n = n
        return self.buf[:n]


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV group
    num_computed_tokens: int
    token_ids: list[int]  # prompt + every token generated so far (the worker appends what it samples)
    output_token_ids: list[int]
    draft_computed: int = 0  # a draft model's KV holds this request's first draft_computed tokens
    # A proposer that samples its drafts: (the drafts it proposed, their distributions [k, V]) for verification
    draft_probs: tuple[list[int], torch.Tensor] | None = None
    mm_images: list[MMImage] = field(default_factory=list)
    # Each image's embeddings once its first position is computed, until its last one is (vLLM's encoder cache,
    # per request: a prompt chunk may end inside an image).
    mm_embeds: dict[int, torch.Tensor] = field(default_factory=dict)
    _mirrors: dict[int, BlockIdMirror] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def block_table(self, group: int) -> torch.Tensor:
        """``block_ids[group]`` as an int64 tensor (CPU; a view, read-only), converted incrementally."""
        ids = self.block_ids[group]
        mirror = self._mirrors.get(group)
        if mirror is None or mirror.ids is not ids:
            mirror = self._mirrors[group] = BlockIdMirror(ids)
        return mirror.tensor()


@dataclass
class ScheduledRow:
    """One sequence of the step, in step order (single-token sequences first)."""

    state: CachedRequestState
    start: int  # num_computed_tokens before this step
    num_tokens: int  # computed this step: known tokens, then the drafts
    sample: bool  # this step reaches the end of the known tokens: sample the next one (and verify the drafts)
    drafts: list[int] = field(default_factory=list)  # speculative tokens verified this step


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    rows: list[ScheduledRow]


class InputBatch:
    def __init__(self, group_names: list[str], tokens_per_block: dict[str, int], block_size: int,
                 device: torch.device) -> None:
        self.group_names = group_names
        self.tokens_per_block = tokens_per_block
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}

    def update(self, sched: SchedulerOutput) -> None:
        """Apply one step's deltas: drop what ended (first: a preempted request comes back as a new one), add the
        new requests, append the running ones' new blocks."""
        for rid in sched.finished_req_ids:
            self.requests.pop(rid, None)
        for r in sched.new_requests:
            self.requests[r.req_id] = CachedRequestState(
                r.req_id, r.prompt_token_ids, r.sampling_params, [list(b) for b in r.block_ids],
                r.num_computed_tokens, list(r.prompt_token_ids) + list(r.output_token_ids),
                list(r.output_token_ids), draft_computed=r.num_computed_tokens, mm_images=list(r.mm_images))
        for r in sched.cached_requests:
            st = self.requests[r.req_id]
            for table, new in zip(st.block_ids, r.new_block_ids):
                table.extend(new)
            st.num_computed_tokens = r.num_computed_tokens

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        rows = []
        for rid, n in sched.num_scheduled_tokens.items():
            st = self.requests[rid]
            start = st.num_computed_tokens
            drafts = sched.scheduled_spec_tokens.get(rid, [])
            known = n - len(drafts)
            rows.append(ScheduledRow(st, start, n, start + known == len(st.token_ids), drafts))
        rows.sort(key=lambda r: r.num_tokens != 1)  # decodes first: attention batches that contiguous slice
        ids: list[int] = []
        for r in rows:
            ids.extend(r.state.token_ids[r.start:r.start + r.num_tokens - len(r.drafts)])
            ids.extend(r.drafts)
        md = AttentionMetadata.build(
            [r.num_tokens for r in rows], [r.start + r.num_tokens for r in rows],
            {name: [r.state.block_table(g) for r in rows] for g, name in enumerate(self.group_names)},
            self.tokens_per_block, self.block_size, self.device)
        return StepInputs(torch.tensor(ids, dtype=torch.long, device=self.device), md.positions, md, rows)

    def append_sampled(self, row: ScheduledRow, token_ids: list[int]) -> None:
        row.state.token_ids.extend(token_ids)
        row.state.output_token_ids.extend(token_ids)
