"""What goes into and out of the engine core, as data (``msgspec.Struct``: the core can move to its own process,
or behind a data-parallel coordinator, with the same types encoded as msgpack - never pickle).

Outputs are deltas: each carries what one request gained this step, plus everything the output processor
needs to build user-facing outputs and metrics (first schedule time, cached tokens, preemptions, finish), so
nothing above the core ever reads the scheduler's live objects.
"""
from __future__ import annotations

import msgspec

from openinfer.sampling_params import SamplingParams
from openinfer.step_io import MMImage


class EngineCoreRequest(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # validated, with the model's eos ids filled in
    arrival_s: float  # time.monotonic() when the request arrived (TTFT counts from here)
    priority: int = 0  # vLLM's: lower first, under the "priority" scheduling policy
    mm_images: list[MMImage] = []  # the prompt's images (multimodal/processor.py), in prompt order


class EngineCoreOutput(msgspec.Struct):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None  # one dict per new token: token id -> logprob
    new_prompt_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache when first scheduled
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    timestamp_s: float = 0.0  # time.monotonic() when this output was made
    # With the final output of a request run for a remote decoder: where its KV waits (vLLM's kv_transfer_params).
    kv_transfer_params: dict | None = None
