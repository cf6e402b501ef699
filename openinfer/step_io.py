"""What crosses the engine <-> executor seam each step: the scheduler's decisions in, sampled tokens out.

Pure data (``msgspec.Struct``), so the same objects go to an in-process worker by reference or to worker
processes encoded as msgpack (never pickle). The scheduler sends each request's full state once
(``NewRequestData``: when it is first scheduled, and again after a preemption) and afterwards only what changed
(``CachedRequestData``: blocks appended to its tables, where its computation stands). Workers keep the rest
themselves, appending the tokens they sample, so a step's message stays small however long the sequences get.
Block ids are per KV group, in the order the model declared its groups (kv_cache_interface.py).
"""
from __future__ import annotations

import msgspec

from openinfer.sampling_params import SamplingParams


class MMImage(msgspec.Struct, array_like=True):
    """One image of a prompt, preprocessed (multimodal/processor.py): it fills prompt positions ``[offset, offset +
    length)`` (the image's start / row / newline / end tokens), its ViT grid is ``n_vit_w x n_vit_h`` patches, and
    ``pixels`` is the resized image, ``width x height`` RGB bytes (HWC uint8), before padding to the grid.
    ``content_hash`` (sha256 hex of the pixels and their size) keys the prefix cache: two different images never
    share cached KV."""

    offset: int
    length: int
    n_vit_w: int
    n_vit_h: int
    width: int
    height: int
    pixels: bytes
    content_hash: str


class NewRequestData(msgspec.Struct):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV group
    num_computed_tokens: int  # tokens already in the cache (prefix hit); this step computes from here
    output_token_ids: list[int] = []  # generated before a preemption: recomputed together with the prompt
    mm_images: list[MMImage] = []  # the prompt's images, in prompt order


class CachedRequestData(msgspec.Struct):
    req_id: str
    new_block_ids: list[list[int]]  # appended to each KV group's table
    num_computed_tokens: int


class KVLoad(msgspec.Struct):
    """One request's prompt KV to read from a remote instance (the KV connector's pull). Block lists per KV group,
    aligned position by position; -1 on either side = nothing to read there (a local prefix hit, or a sliding
    group's block the remote released because no later query reads it)."""

    req_id: str
    local_block_ids: list[list[int]]
    remote_block_ids: list[list[int]]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    push: bool = False  # the producer writes into local_block_ids (send_type PUT) instead of this side reading
    remote_ports: list[int] = []  # per tensor-parallel rank of the producer (empty: remote_port, one rank)


class TierBlock(msgspec.Struct, array_like=True):
    """One full block of one KV group (its index in the model's group order) moving between the pool and the
    offloading tier: its prefix-cache chain key (the chain hash, its parent's and its tokens - for a group block
    spanning several ordinary blocks, the key of the last one: what the tier's file is named by and checked
    against) and its pool block."""

    group: int
    block_hash: int
    parent_hash: int
    token_ids: list[int]
    block_id: int


class TierLoad(msgspec.Struct):
    """A waiting request's prefix blocks to read from the tier into freshly allocated pool blocks."""

    req_id: str
    blocks: list[TierBlock]


class KVConnectorMetadata(msgspec.Struct):
    """What the scheduler side of a KV connector tells its worker side each step; a producer also names the
    requests it now holds for a remote decoder (request id -> block ids per group, -1 = none there) and those it
    stopped holding (expired): a decoder asking for a push is served from these, never from blocks it names."""

    loads: list[KVLoad] = []
    held: dict[str, list[list[int]]] = {}
    released: list[str] = []
    # The offloading tier: blocks to copy out of the pool (before this step's forward may overwrite them) and write
    # to the tier, and prefixes to read back.
    tier_stores: list[TierBlock] = []
    tier_loads: list[TierLoad] = []


class KVConnectorOutput(msgspec.Struct):
    """What the worker side reports back: reads finished or failed (request id -> why), and the producer's held
    requests whose reader said it is done; plus the step's transfer figures."""

    finished_recving: list[str] = []
    failed_recving: dict[str, str] = {}
    finished_sending: list[str] = []
    sending_started: list[str] = []  # producer: held requests a push write now reads from (they must not expire)
    bytes_received: int = 0
    seconds_receiving: float = 0.0
    # The offloading tier: blocks now in its files ((group, chain hash) -> file bytes); entries found stale or
    # corrupt while loading (dropped, their files removed); a write that failed (the tier turns itself off).
    tier_stored: list[tuple[int, int, int]] = []  # (group, chain hash, file bytes)
    tier_invalid: list[tuple[int, int]] = []  # (group, chain hash)
    tier_store_error: str = ""
    tier_bytes_loaded: int = 0
    tier_load_seconds: float = 0.0

    @property
    def empty(self) -> bool:
        return not (self.finished_recving or self.failed_recving or self.finished_sending or self.sending_started)


class SchedulerOutput(msgspec.Struct):
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    # request id -> tokens computed this step, in scheduling order; every scheduled request is in here
    num_scheduled_tokens: dict[str, int] = {}
    # Finished, aborted or preempted since the previous step: workers drop their state (before adding new ones).
    finished_req_ids: list[str] = []
    preempted_req_ids: list[str] = []
    # Speculative decoding: the draft tokens each request verifies this step, after its last known token. They are
    # counted in num_scheduled_tokens (the known tokens computed this step + these).
    scheduled_spec_tokens: dict[str, list[int]] = {}
    # Structured outputs: for each constrained request that samples this step, the tokens its grammar allows at
    # each sampling position (1 + its drafts), one bit per token id in 32-bit little-endian words, rows
    # concatenated (structured_outputs/backend.py).
    grammar_bitmask: dict[str, bytes] = {}
    # Disaggregated prefill/decode: the KV connector's work for this step (None without a connector).
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def empty(self) -> bool:
        return not self.num_scheduled_tokens


class SampledToken(msgspec.Struct):
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None  # token id -> logprob (includes the sampled token)


class ExpertLoadStats(msgspec.Struct):
    """Expert load balancing's last rebalance: the busiest rank's tokens over the mean (summed over MoE layers) in
    the window it closed, under the placement that served that window, and what the same loads give under the new
    placement."""

    num_rebalances: int = 0
    window_steps: int = 0
    imbalance_served: float = 1.0
    imbalance_rebalanced: float = 1.0
    rank_loads_served: list[int] = []


class ModelRunnerOutput(msgspec.Struct):
    """The tokens of every request that reached the end of its known tokens this step - one, or with speculative
    decoding the accepted drafts plus one more - plus prompt logprobs for the prompt positions computed this step
    (requests that asked for them), the next drafts to verify, and the expert-load figures when this step closed a
    load-balancing window."""

    sampled: dict[str, list[SampledToken]] = {}
    spec_token_ids: dict[str, list[int]] = {}
    spec_confidence: dict[str, list[float]] = {}  # the proposer's predicted acceptance of each draft, if it has one
    prompt_logprobs: dict[str, list[dict[int, float]]] = {}
    expert_load: ExpertLoadStats | None = None
    # Rows whose own work failed this step (sampling, verifying, prompt logprobs): request id -> the error. Those
    # requests end with an error; the rest of the batch is unaffected.
    failed: dict[str, str] = {}
    kv_connector_output: KVConnectorOutput | None = None
