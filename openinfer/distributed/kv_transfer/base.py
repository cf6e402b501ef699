"""The KV connector seam (vLLM's KVConnector v1 shape). Pure Python on the scheduler side: no torch here.

Scheduler side, called by the scheduler:
- ``get_num_new_matched_tokens(req, num_computed)``: how many prompt tokens past the local prefix hit an outside
  source supplies, and whether they arrive asynchronously (the request then waits in WAITING_FOR_REMOTE_KVS with
  its blocks allocated, and does not hold back the requests behind it).
- ``update_state_after_alloc(req, block_ids, num_local_tokens)``: the blocks (per KV group, in the model's group
  order) the request now owns, so the connector knows where the outside tokens go.
- ``build_connector_meta()``: this step's work for the worker side.
- ``update_connector_output(out)``: what the worker side reported (loads done or failed, sends done).
- ``request_finished(req, block_ids)``: whether to keep the blocks after the request ends (someone else will read
  them) and the ``kv_transfer_params`` to return to the client.
- ``expired_sends(now)``: held requests whose reader never came; their blocks go back to the pool.
- ``blocks_released(req, keys, block_ids)``: the request's blocks go back to the pool (it ended or was
  preempted); its first ``len(keys)`` blocks hold computed KV of known tokens (an offloading tier stores them).

A connector that reads a prefix (``get_num_new_matched_tokens`` > 0, asynchronously) supplies exactly that many
tokens past the local hit: once its read is done they count as computed (never the last prompt token: its logits
are needed).

Worker side, called by the model runner every step (also steps with nothing to compute, while the scheduler side
has work in flight): ``start_load_kv(meta)``, ``wait_for_save()`` after the forward, ``get_finished()``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from openinfer.step_io import KVConnectorMetadata, KVConnectorOutput


class ConnectorRequest(Protocol):
    """What a connector reads of the engine's request (engine/request.py; not imported: imports point down)."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int
    all_token_ids: list[int]  # prompt + generated
    block_hashes: list[int]  # prefix-cache chain hashes of its full blocks hashed so far
    sampling_params: Any

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


class KVConnectorScheduler(ABC):
    # Whether ``blocks_released`` does anything (an offloading tier): the scheduler skips computing its arguments
    # otherwise.
    stores_blocks: bool = False

    @abstractmethod
    def validate_params(self, params: dict[str, Any] | None, num_prompt_tokens: int, block_size: int) -> None:
        """Raise ValueError naming the field when a request's kv_transfer_params cannot be served here."""

    @abstractmethod
    def get_num_new_matched_tokens(self, req: ConnectorRequest, params: dict[str, Any] | None,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        ...

    @abstractmethod
    def update_state_after_alloc(self, req: ConnectorRequest, params: dict[str, Any],
                                 block_ids: list[list[int]], num_local_blocks: list[int]) -> None:
        ...

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        ...

    @abstractmethod
    def update_connector_output(self, out: KVConnectorOutput) -> None:
        """Figures and bookkeeping; the scheduler acts on the request ids itself."""

    @abstractmethod
    def request_finished(self, req: ConnectorRequest, params: dict[str, Any] | None, finished_ok: bool,
                         block_ids: list[list[int]], now: float) -> tuple[bool, dict[str, Any] | None]:
        ...

    @abstractmethod
    def expired_sends(self, now: float) -> list[str]:
        ...

    @abstractmethod
    def has_pending_work(self) -> bool:
        """Loads or held sends in flight: the engine keeps stepping (polling the worker side) while true."""

    def set_side_channel(self, info: dict[str, Any]) -> None:
        """Where the worker side listens (it picks the port at start-up); advertised in kv_transfer_params."""

    def blocks_released(self, req: ConnectorRequest, keys: list[tuple[int, tuple[int, ...]]],
                        block_ids: list[list[int]]) -> None:
        """Blocks going back to the pool; ``keys[i]`` is the chain key (parent hash, token ids) of block i, whose
        computed KV sits in ``block_ids[g][i]`` of each group g (-1: none there)."""

    def record_events(self) -> None:
        """Start recording KV events (kv_events.py) for the connector's own tier."""

    def take_events(self) -> list:
        return []


class KVConnectorWorker(ABC):
    @abstractmethod
    def register_kv_caches(self, groups: dict[str, list[Any]]) -> dict[str, Any]:
        """The KV stores per group (tensors whose first dim is the block id); returns the side-channel info the
        scheduler side advertises."""

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        ...

    def wait_for_save(self) -> None:
        """After the forward: a connector that writes layers out waits for them here (pull mode writes nothing)."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        ...

    def shutdown(self) -> None:
        ...
