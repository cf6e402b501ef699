"""The NixlConnector's scheduler side: vLLM's kv_transfer_params protocol, pure Python (no torch, no NIXL).

Producer (prefill instance): a request sent with ``{"do_remote_decode": true}`` runs normally (the router asks
for max_tokens=1); when it ends, its blocks are *held* and the response carries where they are:
``do_remote_prefill``, ``remote_engine_id``, ``remote_block_ids``, ``remote_request_id``, ``remote_host``,
``remote_port``, ``tp_size`` - vLLM's NixlConnector fields. They go back to the pool when the reader notifies
(NIXL notification carrying ``remote_request_id``) or after ``abort_request_timeout_s``.

Consumer (decode instance): a request with those params first gets blocks for its whole prompt (past any local
prefix hit) and waits for the worker side to read the remote blocks into them; then all but the last prompt
token count as computed (the last is recomputed here for its logits, as vLLM does). A read that fails or times
out, or params that do not fit this instance, fall back to computing the prompt here.

``remote_block_ids`` is one list per KV group when the model has several (one flat list, as vLLM sends, for one
group); -1 marks a sliding group's block the producer released (never read by a later query).
"""
from __future__ import annotations

import logging
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from openinfer.config import KVTransferConfig
from openinfer.distributed.kv_transfer.base import ConnectorRequest, KVConnectorScheduler
from openinfer.distributed.kv_transfer.side_channel import ReleaseRequest, release_held
from openinfer.distributed.kv_transfer.stats import KVTransferStats
from openinfer.step_io import KVConnectorMetadata, KVConnectorOutput, KVLoad

logger = logging.getLogger(__name__)

_REMOTE_FIELDS = {"remote_engine_id": str, "remote_request_id": str, "remote_host": str, "remote_port": int}


def group_block_lists(value: Any) -> list[list[int]]:
    """remote_block_ids as one list per group of the producer (a flat list is its one group's). How many groups it
    has is not checked here: a producer with another layout (another model, no drafter) is named by the handshake,
    which also tells it to free the prompt it holds."""
    if not isinstance(value, list):
        raise ValueError(f"kv_transfer_params.remote_block_ids must be a list, got {type(value).__name__}")
    lists = [value] if all(isinstance(b, int) for b in value) else value
    if not lists or not all(isinstance(g, list) for g in lists):
        raise ValueError("kv_transfer_params.remote_block_ids must be a list of block ids, or one such list per KV "
                         "group")
    for g in lists:
        if any(isinstance(b, bool) or not isinstance(b, int) or b < -1 for b in g):
            raise ValueError("kv_transfer_params.remote_block_ids must be block ids (integers >= -1)")
    return lists


def _log_release_failure(fut: Future) -> None:
    if fut.exception() is not None:
        logger.info("could not free a refused prompt at its producer (it frees it at its abort timeout): %s",
                    fut.exception())


class NixlConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, group_tokens_per_block: list[int], engine_id: str | None = None,
                 tp_size: int = 1) -> None:
        self.config = config
        self.engine_id = engine_id or config.engine_id or uuid.uuid4().hex  # a data-parallel replica's: ranks.py
        self.tokens_per_block = list(group_tokens_per_block)
        self.tp_size = tp_size  # this replica's ranks: each moves its own shard (its own agent and side channel)
        self.host = config.side_channel_host
        self.port = config.side_channel_port
        self.ports: list[int] = []  # every rank's side channel, in tensor-parallel rank order
        self.stats = KVTransferStats()
        self._tried: set[str] = set()  # consumer: requests whose remote read was attempted (once only)
        self._pending: list[KVLoad] = []  # consumer: loads not yet handed to the worker side
        self._loading: set[str] = set()
        self._sends: dict[str, float] = {}  # producer: held request id -> deadline (time.monotonic)
        self._new_held: dict[str, list[list[int]]] = {}  # producer: held since the last step, for the worker side
        self._released: list[str] = []  # producer: expired since the last step
        self._undelivered = False  # the last metadata built names held or released prompts
        self._writing: set[str] = set()  # producer: held requests a push write reads from (never expired meanwhile)
        self._releaser: ThreadPoolExecutor | None = None  # consumer: tells producers of refused prompts to free them

    def set_side_channel(self, info: dict[str, Any]) -> None:
        self.host, self.port = info["host"], info["port"]
        self.ports = list(info.get("ports", [self.port]))

    # -- requests -----------------------------------------------------------------------------------------
    def validate_params(self, params: dict[str, Any] | None, num_prompt_tokens: int, block_size: int) -> None:
        if params is None:
            return
        for key in ("do_remote_decode", "do_remote_prefill"):
            if params.get(key) is not None and not isinstance(params[key], bool):
                raise ValueError(f"kv_transfer_params.{key} must be a boolean, got {params[key]!r}")
        if params.get("do_remote_decode") and not self.config.is_producer:
            raise ValueError(f"kv_transfer_params.do_remote_decode needs an instance started as kv_producer or "
                             f"kv_both; this one is {self.config.kv_role}")
        if params.get("do_remote_prefill"):
            if not self.config.is_consumer:
                raise ValueError(f"kv_transfer_params.do_remote_prefill needs an instance started as kv_consumer "
                                 f"or kv_both; this one is {self.config.kv_role}")
            for key, kind in _REMOTE_FIELDS.items():
                if not isinstance(params.get(key), kind) or isinstance(params.get(key), bool):
                    raise ValueError(f"kv_transfer_params.{key} must be a {kind.__name__}, got "
                                     f"{params.get(key)!r}")
            tp = params.get("tp_size", 1)
            if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
                raise ValueError(f"kv_transfer_params.tp_size must be an integer >= 1, got {tp!r}")
            ports = params.get("remote_ports")
            if tp > 1 and (not isinstance(ports, list) or len(ports) != tp
                           or any(isinstance(p, bool) or not isinstance(p, int) for p in ports)):
                raise ValueError(f"kv_transfer_params.remote_ports must list the producer's {tp} ranks' side-channel "
                                 f"ports (tp_size={tp}), got {ports!r}")
            group_block_lists(params.get("remote_block_ids"))
            if tp != self.tp_size and max(tp, self.tp_size) % min(tp, self.tp_size):
                # Another size is moved where one divides the other: each rank takes its slice of the heads from
                # the ranks holding it, or a whole latent cache from one of them (tp_slices.py). A real producer's
                # prompt refused here is freed there now (well-formed params say where it is held).
                self.release_remote(params)
                raise ValueError(f"kv_transfer_params.tp_size={tp!r} (the prefill instance's "
                                 f"tensor_parallel_size) and this instance's tensor_parallel_size={self.tp_size}: "
                                 "one must divide the other")

    def release_remote(self, params: dict[str, Any]) -> None:
        """A prompt held for this instance that it will not read (its params do not fit here): tell every producer
        rank holding it to free it now, rather than at its abort timeout. On a thread, bounded; best effort (a
        producer not reached frees at its timeout)."""
        ports = params.get("remote_ports")
        if not isinstance(ports, list) or not ports or not all(type(p) is int for p in ports):
            ports = [params["remote_port"]]
        req = ReleaseRequest(self.engine_id, params["remote_engine_id"], params["remote_request_id"])
        if self._releaser is None:
            self._releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-release")
        for port in ports:
            fut = self._releaser.submit(release_held, params["remote_host"], port, req, 2.0)
            fut.add_done_callback(_log_release_failure)

    def _remote_blocks_fit(self, req: ConnectorRequest, remote: list[list[int]]) -> bool:
        """The producer's tables cover exactly this prompt (the same tokenization)."""
        n = req.num_prompt_tokens
        return all(len(ids) == -(-n // r) for ids, r in zip(remote, self.tokens_per_block))

    def get_num_new_matched_tokens(self, req: ConnectorRequest, params: dict[str, Any] | None,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        if not params or not params.get("do_remote_prefill") or req.request_id in self._tried:
            return 0, False
        # Tried means the read was queued (update_state_after_alloc) or refused here, not merely asked about: a
        # decoder short of blocks asks again on a later step, and must still read the prompt then rather than
        # recompute it while the producer holds its blocks until they expire.
        remote = group_block_lists(params["remote_block_ids"])
        if len(remote) == len(self.tokens_per_block) and not self._remote_blocks_fit(req, remote):
            self._tried.add(req.request_id)
            logger.warning("request %s: remote_block_ids do not cover its %d prompt tokens (another block_size or "
                           "tokenization?); computing the prompt here", req.request_id, req.num_prompt_tokens)
            self.stats.fallbacks += 1
            self.release_remote(params)
            return 0, False
        return req.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, req: ConnectorRequest, params: dict[str, Any],
                                 block_ids: list[list[int]], num_local_blocks: list[int]) -> None:
        self._tried.add(req.request_id)
        remote = group_block_lists(params["remote_block_ids"])
        local = [[-1 if j < skip else b for j, b in enumerate(ids)] for ids, skip in zip(block_ids, num_local_blocks)]
        self._pending.append(KVLoad(req.request_id, local, remote, params["remote_engine_id"],
                                    params["remote_request_id"], params["remote_host"], params["remote_port"],
                                    push=self.config.push, remote_ports=list(params.get("remote_ports") or [])))
        self._loading.add(req.request_id)

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._pending, held=self._new_held, released=self._released)
        self._pending, self._new_held, self._released = [], {}, []
        # This step must reach the worker side even if it computes nothing: a release it missed would leave the
        # worker serving a push from blocks already back in the pool.
        self._undelivered = bool(meta.held or meta.released)
        return meta

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        for rid in out.finished_recving:
            if rid in self._loading:
                self._loading.discard(rid)
                self.stats.loads_ok += 1
        for rid in out.failed_recving:
            if rid in self._loading:
                self._loading.discard(rid)
                self.stats.load_failures += 1
                self.stats.fallbacks += 1
        self.stats.bytes_received += out.bytes_received
        self.stats.seconds_receiving += out.seconds_receiving
        self._writing.update(out.sending_started)
        for rid in out.finished_sending:
            self._writing.discard(rid)
            self._new_held.pop(rid, None)  # freed before the worker side heard it was held: it never will
            if self._sends.pop(rid, None) is not None:
                self.stats.sends_ok += 1

    def cancel_load(self, request_id: str) -> None:
        """The request ended (aborted) while its read was in flight: forget it; a late report is ignored."""
        self._loading.discard(request_id)
        self._pending = [ld for ld in self._pending if ld.req_id != request_id]

    def request_finished(self, req: ConnectorRequest, params: dict[str, Any] | None, finished_ok: bool,
                         block_ids: list[list[int]], now: float) -> tuple[bool, dict[str, Any] | None]:
        self._tried.discard(req.request_id)
        self.cancel_load(req.request_id)
        if not params or not params.get("do_remote_decode") or not finished_ok:
            return False, None
        self._sends[req.request_id] = now + self.config.abort_request_timeout_s
        # The prompt's blocks only: with speculative decoding the request also holds lookahead slots past it
        # (a drafter's chain KV), which no decoder reads (the decoder allocates just the prompt's before reading).
        n = req.num_prompt_tokens
        block_ids = [list(g[:-(-n // r)]) for g, r in zip(block_ids, self.tokens_per_block)]
        self._new_held[req.request_id] = block_ids
        ids: list[Any] = block_ids[0] if len(block_ids) == 1 else block_ids
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_block_ids": ids, "remote_request_id": req.request_id, "remote_host": self.host,
            "remote_port": self.port, "tp_size": self.tp_size,
            # openinfer's addition for several ranks: each rank's side channel (rank i of the decoder pairs with i)
            **({"remote_ports": list(self.ports)} if self.tp_size > 1 else {}),
        }

    def expired_sends(self, now: float) -> list[str]:
        # A prompt a push write still reads from stays until the write is over (it ends within load_timeout_s, or
        # once NIXL can abort it): its blocks freed now could be refilled while the write sends them.
        gone = [rid for rid, deadline in self._sends.items() if deadline <= now and rid not in self._writing]
        for rid in gone:
            del self._sends[rid]
            self._new_held.pop(rid, None)
            self._released.append(rid)
            self.stats.sends_expired += 1
        if gone:
            logger.warning("freeing %d held prompt(s) no decoder read within %.0f s: %s", len(gone),
                           self.config.abort_request_timeout_s, gone[:5])
        return gone

    def has_pending_work(self) -> bool:
        return bool(self._sends or self._loading or self._pending or self._released or self._undelivered)
