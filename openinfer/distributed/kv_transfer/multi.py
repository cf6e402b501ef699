"""Two KV connectors at once (vLLM's MultiConnector, for the pair openinfer has): prefill/decode disaggregation
(NIXL) and the offloading tier. A request with kv_transfer_params is the transfer connector's; every other prefix
lookup, every store and the tier's events are the tier's. Each side ignores reports about requests it does not
track, and the tier reports its bytes apart, so the two sets of figures stay separate."""
from __future__ import annotations

from typing import Any

from openinfer.distributed.kv_transfer.base import ConnectorRequest, KVConnectorScheduler, KVConnectorWorker
from openinfer.step_io import KVConnectorMetadata, KVConnectorOutput


class MultiConnectorScheduler(KVConnectorScheduler):
    stores_blocks = True

    def __init__(self, transfer: KVConnectorScheduler, tier: KVConnectorScheduler) -> None:
        self.transfer = transfer
        self.tier = tier
        self._owner: dict[str, KVConnectorScheduler] = {}  # request id -> who supplies its prefix

    def set_side_channel(self, info: dict[str, Any]) -> None:
        self.transfer.set_side_channel(info)

    def validate_params(self, params: dict[str, Any] | None, num_prompt_tokens: int, block_size: int) -> None:
        self.transfer.validate_params(params, num_prompt_tokens, block_size)

    def get_num_new_matched_tokens(self, req: ConnectorRequest, params: dict[str, Any] | None,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        if params:
            n, is_async = self.transfer.get_num_new_matched_tokens(req, params, num_computed_tokens)
            if n > 0:
                self._owner[req.request_id] = self.transfer
                return n, is_async
        n, is_async = self.tier.get_num_new_matched_tokens(req, params, num_computed_tokens)
        if n > 0:
            self._owner[req.request_id] = self.tier
        return n, is_async

    def update_state_after_alloc(self, req: ConnectorRequest, params: dict[str, Any] | None,
                                 block_ids: list[list[int]], num_local_blocks: list[int]) -> None:
        self._owner.pop(req.request_id).update_state_after_alloc(req, params, block_ids, num_local_blocks)

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = self.transfer.build_connector_meta()
        tier = self.tier.build_connector_meta()
        meta.tier_stores, meta.tier_loads = tier.tier_stores, tier.tier_loads
        return meta

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        self.transfer.update_connector_output(out)
        self.tier.update_connector_output(out)

    def request_finished(self, req: ConnectorRequest, params: dict[str, Any] | None, finished_ok: bool,
                         block_ids: list[list[int]], now: float) -> tuple[bool, dict[str, Any] | None]:
        self._owner.pop(req.request_id, None)
        self.tier.request_finished(req, params, finished_ok, block_ids, now)
        return self.transfer.request_finished(req, params, finished_ok, block_ids, now)

    def expired_sends(self, now: float) -> list[str]:
        return self.transfer.expired_sends(now)

    def has_pending_work(self) -> bool:
        return self.transfer.has_pending_work() or self.tier.has_pending_work()

    @property
    def has_unsent_stores(self) -> bool:
        return self.tier.has_unsent_stores

    def blocks_released(self, req: ConnectorRequest, keys: list[tuple[int, tuple[int, ...]]],
                        block_ids: list[list[int]]) -> None:
        self.tier.blocks_released(req, keys, block_ids)

    def record_events(self) -> None:
        self.tier.record_events()

    def take_events(self) -> list:
        return self.tier.take_events()


class MultiConnectorWorker(KVConnectorWorker):
    def __init__(self, transfer: KVConnectorWorker, tier: KVConnectorWorker) -> None:
        self.transfer = transfer
        self.tier = tier

    def register_kv_caches(self, groups: dict[str, list[Any]]) -> dict[str, Any]:
        raise RuntimeError("each connector registers the caches itself before they are combined")

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        self.tier.start_load_kv(meta)  # first: its stores copy rows out before anything may write them
        self.transfer.start_load_kv(meta)

    def wait_for_save(self) -> None:
        self.transfer.wait_for_save()
        self.tier.wait_for_save()

    def get_finished(self) -> KVConnectorOutput:
        a, b = self.transfer.get_finished(), self.tier.get_finished()
        a.finished_recving = a.finished_recving + b.finished_recving
        a.failed_recving = {**a.failed_recving, **b.failed_recving}
        a.tier_stored, a.tier_invalid, a.tier_store_error = b.tier_stored, b.tier_invalid, b.tier_store_error
        a.tier_bytes_loaded, a.tier_load_seconds = b.tier_bytes_loaded, b.tier_load_seconds
        return a

    def shutdown(self) -> None:
        self.transfer.shutdown()
        self.tier.shutdown()
