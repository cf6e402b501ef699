"""The offloading tier's scheduler side (vLLM's OffloadingConnector shape): the index of what the tier holds, in
LRU order, and this step's stores and loads for the worker side. Pure Python: no torch.

- Entries are per KV group: one file per (group, group block). A group block spanning c ordinary blocks
  (DeepSeek-V4's compressed entries) is keyed by the chain key of the last ordinary block it covers, as in the pool.
- Stores: when a request's blocks go back to the pool (it ended or was preempted), each full group block of
  computed KV that the tier lacks is named in the next step's metadata - a sliding group's blocks behind its window
  only while the pool still caches them (a hit needs just the window before it). The worker side copies them out of
  the pool before that step's forward (nothing can overwrite them earlier) and writes the files on a background
  thread. An entry joins the index once the worker side reports it written: a lookup never names a file in flight.
- Loads: a waiting request's longest prefix past the pool's hit for which every group has what the first
  recomputed query reads - a whole-life group all its blocks, a sliding group those within its lookback - in the
  pool's hit or in the index (chain key checked: parent hash and tokens) is supplied asynchronously: the scheduler
  parks the request with fresh blocks, the worker side reads the files into them (checking fingerprint, key and
  checksum) and the request resumes with them computed. A file found stale or corrupt fails the read: its entry is
  dropped and the prompt recomputed.
- LRU within ``size_gb``: entries are used (moved to the back) when a lookup hits or a request releases the block;
  the front is evicted (its file removed) when a new entry would pass the size. Entries being read are never
  evicted.
- A failed write (the disk is full, the folder gone, the shared store down) turns the tier off: one warning, no
  more stores or lookups; requests go on, computing their prefixes.
- A shared store (RedisStore) is written by other instances too: a lookup asks it (one pipelined round trip) for
  the blocks this instance's index lacks, and its server evicts by its own policy; the chain key of such a block is
  checked when it is read (its header), a mismatch dropping it like a corrupt one.
- Tensor parallel: each rank stores and reads its own shard of every group block (one file per rank, the rank in
  its name and header). An entry joins the index only once every rank reported its file written, and a lookup on a
  shared store asks for every rank's: a hit is decided here, once, for all ranks, which the worker sides then read
  in lockstep (offload_worker.py: a read or a write is reported only when every rank's is over, failed if one's
  failed).
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openinfer.config import KVOffloadConfig
from openinfer.distributed.kv_transfer.base import ConnectorRequest, KVConnectorScheduler
from openinfer.distributed.kv_transfer.stats import KVOffloadStats
from openinfer.distributed.kv_transfer.tier_files import SUFFIX, TierFileError, file_name, file_names, read_header
from openinfer.distributed.kv_transfer.tier_store import DirStore, RedisStore, TierStoreError
from openinfer.kv_events import BlockRemoved, BlockStored, EventRecorder, KVEvent, external_hash
from openinfer.step_io import KVConnectorMetadata, KVConnectorOutput, TierBlock, TierLoad

logger = logging.getLogger(__name__)

# vLLM's medium for a tier on disk (KV events, metrics labels).
MEDIUM = "DISK"


@dataclass(frozen=True)
class TierGroup:
    """What the tier needs of a KV group: ordinary blocks per group block, the lookback (None: whole life), and
    whether it holds anything (a group of 0 bytes per block - a DeepSeek-V4 MTP layer's compressed groups - has no
    files and never bounds a hit)."""

    ratio: int
    lookback_tokens: int | None = None
    stored: bool = True

    def first_needed(self, num_tokens: int, block_size: int) -> int:
        """First group block a query at ``num_tokens`` reads (kv_groups.py's policy)."""
        if self.lookback_tokens is None:
            return 0
        return max(0, num_tokens - self.lookback_tokens) // (self.ratio * block_size)


@dataclass
class _Entry:
    parent_hash: int
    token_ids: tuple[int, ...]
    num_bytes: int


class OffloadingConnectorScheduler(EventRecorder, KVConnectorScheduler):
    stores_blocks = True

    def __init__(self, config: KVOffloadConfig, store: DirStore | RedisStore, fingerprint: str, block_size: int,
                 root_hash: int, groups: list[TierGroup], tp: int = 1) -> None:
        self.config = config
        self.tp = tp  # tensor-parallel ranks: files per group block
        self.store = store
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.root_hash = root_hash  # the parent of every chain's first block (the prefix cache's)
        self.groups = groups
        # A shared store's server evicts by its own policy: there the size bounds only what this instance remembers
        # (an entry it forgets stays in the store, and a lookup finds it again).
        self.capacity_bytes = config.size_bytes
        self.stats = KVOffloadStats()
        # (group, chain hash) -> entry; front = least recently used
        self._index: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self._pinned: dict[tuple[int, int], int] = {}  # entry -> reads in flight
        self._storing: dict[tuple[int, int], TierBlock] = {}  # handed to the worker side, not reported yet
        self._new_stores: list[TierBlock] = []
        self._new_loads: list[TierLoad] = []
        self._lookups: dict[str, list[TierBlock]] = {}  # request id -> the tier's part of its prefix (not allocated)
        self._loading: dict[str, list[tuple[int, int]]] = {}  # request id -> the entries it reads
        self._counted: set[str] = set()  # requests whose lookup is in the figures (a retry is not counted again)
        self._events: list[KVEvent] | None = None
        self._present: set[tuple[int, int]] = set()  # a shared store's blocks found by this lookup
        if isinstance(store, DirStore):
            self._scan(store.directory)

    # -- the index --------------------------------------------------------------------------------------------
    def _scan(self, directory: Path) -> None:
        """Rebuild the index from the files a previous run left (their headers only; checksums are checked when a
        block is read), oldest first. Files from another fingerprint or unreadable ones are removed."""
        found: dict[tuple[int, int], list] = {}  # key -> [newest mtime, header, bytes, files]
        for p in directory.iterdir():
            if p.name.endswith(".tmp"):  # a write cut short by a crash
                _unlink(p)
                continue
            if not p.name.endswith(SUFFIX):
                continue
            try:
                with open(p, "rb") as f:
                    header, _, _ = read_header(f)
                rank = header.rank if self.tp > 1 else None
                if (header.fingerprint != self.fingerprint or not 0 <= header.rank < self.tp
                        or p.name != file_name(header.group, header.block_hash, rank)
                        or not 0 <= header.group < len(self.groups)):
                    raise TierFileError("another model or layout")
                st = p.stat()
            except (OSError, TierFileError) as e:
                logger.warning("KV tier: dropping %s (%s)", p.name, e)
                self.stats.blocks_invalid += 1
                _unlink(p)
                continue
            f = found.setdefault((header.group, header.block_hash), [0, header, 0, []])
            f[0], f[2] = max(f[0], st.st_mtime_ns), f[2] + st.st_size
            f[3].append(p)
        for key, (_, h, size, paths) in sorted(found.items(), key=lambda x: x[1][0]):
            if len(paths) != self.tp:  # some rank's file never made it (a crash, a full disk): unusable
                for p in paths:
                    _unlink(p)
                self.stats.blocks_invalid += 1
                continue
            self._index[key] = _Entry(h.parent_hash, tuple(h.token_ids), size)
            self.stats.bytes_used += size
        self._evict_to_fit()
        self.stats.num_blocks = len(self._index)
        if self._index:
            logger.info("KV tier: %d blocks (%.1f MiB) reused from %s", len(self._index),
                        self.stats.bytes_used / 2**20, directory)

    def _drop(self, key: tuple[int, int], evicted: bool) -> None:
        entry = self._index.pop(key, None)
        if entry is None:
            return
        self.stats.bytes_used -= entry.num_bytes
        self.stats.num_blocks = len(self._index)
        if evicted:
            self.stats.blocks_evicted += 1
        else:
            self.stats.blocks_invalid += 1
        if not (evicted and self.store.shared):  # others may still use a shared store's block
            self._remove(*key)
        if self._events is not None and key[0] == 0:  # events speak for the first group, as the pool's do
            self._events.append(BlockRemoved([external_hash(key[1])], MEDIUM))

    def _remove(self, group: int, block_hash: int) -> None:
        for name in file_names(group, block_hash, self.tp):
            self.store.remove(name)

    def _evict_to_fit(self) -> None:
        victims = iter(list(self._index))
        while self.stats.bytes_used > self.capacity_bytes:
            h = next(victims, None)
            if h is None:
                break  # everything left is being read
            if h not in self._pinned:
                self._drop(h, evicted=True)

    def _add(self, block: TierBlock, num_bytes: int) -> None:
        self._index[(block.group, block.block_hash)] = _Entry(block.parent_hash, tuple(block.token_ids), num_bytes)
        self.stats.bytes_used += num_bytes
        self.stats.blocks_stored += 1
        self.stats.bytes_stored += num_bytes
        if self._events is not None and block.group == 0:
            parent = None if block.parent_hash == self.root_hash else external_hash(block.parent_hash)
            self._events.append(BlockStored([external_hash(block.block_hash)], parent, list(block.token_ids),
                                            len(block.token_ids), None, MEDIUM, None))
        self._evict_to_fit()
        self.stats.num_blocks = len(self._index)

    def _turn_off(self, why: str) -> None:
        if not self.stats.enabled:
            return
        self.stats.enabled = False
        logger.warning("KV tier at %s turned itself off: the store failed (%s); prefixes evicted from the pool are "
                       "recomputed from now on", self.store, why)
        self._storing.clear()
        self._new_stores.clear()

    # -- the connector seam -----------------------------------------------------------------------------------
    def validate_params(self, params: dict[str, Any] | None, num_prompt_tokens: int, block_size: int) -> None:
        if params:
            raise ValueError("kv_transfer_params needs an engine started with kv_transfer_config; this one has the "
                             "KV offloading tier only")

    def _entry(self, req: ConnectorRequest, group: int, j: int) -> TierBlock | None:
        """Group block j of the request, if the index holds it under the same chain key (its ``block_id`` holds
        the table position j until the pool block is known)."""
        bs = self.block_size
        i = (j + 1) * self.groups[group].ratio - 1  # the ordinary block whose key it carries
        h = req.block_hashes[i]
        e = self._index.get((group, h))
        parent = self.root_hash if i == 0 else req.block_hashes[i - 1]
        ids = req.all_token_ids[i * bs:(i + 1) * bs]
        if e is None:
            if (group, h) not in self._present:
                return None
        elif e.parent_hash != parent or e.token_ids != tuple(ids):
            return None
        return TierBlock(group, h, parent, ids, j)

    def _tier_part(self, req: ConnectorRequest, local: int, h: int) -> list[TierBlock] | None:
        """The entries a hit of ``h`` ordinary blocks needs past a pool hit of ``local``; None if one is missing."""
        bs = self.block_size
        out = []
        for gi, g in enumerate(self.groups):
            if not g.stored:
                continue
            local_end = local // g.ratio
            for j in range(max(g.first_needed(h * bs, bs), local_end), h // g.ratio):
                b = self._entry(req, gi, j)
                if b is None:
                    return None
                out.append(b)
        return out

    def get_num_new_matched_tokens(self, req: ConnectorRequest, params: dict[str, Any] | None,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        if not self.stats.enabled or req.sampling_params.prompt_logprobs is not None:
            return 0, False  # prompt_logprobs need every prompt position computed
        bs = self.block_size
        local = num_computed_tokens // bs
        # Never the last token (its logits are needed); only blocks the prefix cache has hashed.
        end = min((req.num_tokens - 1) // bs, len(req.block_hashes))
        if self.store.shared and not self._ask_store(req, local, end):
            return 0, False
        # Whole-life groups need every block: the longest run of them bounds the hit. Then the largest hit whose
        # sliding groups have their window wins (as KVCacheManager.get_computed_blocks picks pool hits).
        top = end
        for gi, g in enumerate(self.groups):
            if g.lookback_tokens is None and g.stored:
                j = local // g.ratio
                while (j + 1) * g.ratio <= top and self._entry(req, gi, j) is not None:
                    j += 1
                top = min(top, j * g.ratio + g.ratio - 1)
        found: list[TierBlock] = []
        h = top
        while h > local:
            part = self._tier_part(req, local, h)
            if part:
                found = part
                break
            h -= 1
        self._present.clear()
        if req.request_id not in self._counted:
            self._counted.add(req.request_id)
            self.stats.queries += max(0, end - local) * bs
            self.stats.hits += (h - local) * bs if found else 0
        if not found:
            return 0, False
        self._lookups[req.request_id] = found
        return (h - local) * bs, True

    def _ask_store(self, req: ConnectorRequest, local: int, end: int) -> bool:
        """A shared store: which of the candidate blocks past the pool's hit it holds that the index lacks (one
        round trip). False: the store failed (the tier is now off)."""
        want = []
        for gi, g in enumerate(self.groups):
            for j in range(local // g.ratio, end // g.ratio) if g.stored else ():
                key = (gi, req.block_hashes[(j + 1) * g.ratio - 1])
                if key not in self._index:
                    want.append(key)
        try:
            found = self.store.exists([n for k in want for n in file_names(*k, self.tp)])
        except TierStoreError as e:
            self._turn_off(str(e))
            return False
        # A block is there only if every rank's shard is.
        self._present = {k for i, k in enumerate(want) if all(found[i * self.tp:(i + 1) * self.tp])}
        return True

    def update_state_after_alloc(self, req: ConnectorRequest, params: dict[str, Any] | None,
                                 block_ids: list[list[int]], num_local_blocks: list[int]) -> None:
        blocks = self._lookups.pop(req.request_id)
        keys = []
        for b in blocks:
            b.block_id = block_ids[b.group][b.block_id]  # table position -> pool block
            key = (b.group, b.block_hash)
            keys.append(key)
            self._pinned[key] = self._pinned.get(key, 0) + 1
            if key in self._index:
                self._index.move_to_end(key)
        self._new_loads.append(TierLoad(req.request_id, blocks))
        self._loading[req.request_id] = keys

    def blocks_released(self, req: ConnectorRequest, keys: list[tuple[int, tuple[int, ...]]],
                        block_ids: list[list[int]]) -> None:
        self._counted.discard(req.request_id)
        if not self.stats.enabled:
            return
        for gi, g in enumerate(self.groups):
            ids = block_ids[gi]
            for j in range(min(len(keys) // g.ratio, len(ids)) if g.stored else 0):
                i = (j + 1) * g.ratio - 1
                key = (gi, req.block_hashes[i])
                if key in self._index:
                    self._index.move_to_end(key)  # used again: evicted later
                    continue
                if key in self._storing or ids[j] < 0:  # in flight, or released behind a sliding window
                    continue
                parent, token_ids = keys[i]
                block = TierBlock(gi, key[1], parent, list(token_ids), ids[j])
                self._storing[key] = block
                self._new_stores.append(block)

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(tier_stores=self._new_stores, tier_loads=self._new_loads)
        self._new_stores, self._new_loads = [], []
        return meta

    def _unpin(self, rid: str) -> list[tuple[int, int]]:
        hashes = self._loading.pop(rid, [])
        for h in hashes:
            n = self._pinned.get(h, 0) - 1
            if n > 0:
                self._pinned[h] = n
            else:
                self._pinned.pop(h, None)
        return hashes

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        for rid in out.finished_recving:
            if rid in self._loading:
                self._unpin(rid)
                self.stats.loads += 1
        for rid, why in out.failed_recving.items():
            if rid in self._loading:
                self._unpin(rid)
                self.stats.load_failures += 1
                logger.warning("KV tier: request %s: reading its prefix failed (%s); computing it", rid, why)
        self.stats.bytes_loaded += out.tier_bytes_loaded
        self.stats.load_seconds += out.tier_load_seconds
        for group, h in out.tier_invalid:
            self._drop((group, h), evicted=False)
        for group, h, num_bytes in out.tier_stored:
            block = self._storing.pop((group, h), None)
            if block is not None and self.stats.enabled:
                self._add(block, num_bytes)
            elif block is None and not self.store.shared:  # the tier turned off meanwhile: not indexed, so remove it
                self._remove(group, h)
        if out.tier_store_error:
            self._turn_off(out.tier_store_error)
        self._evict_to_fit()  # entries that were being read may go now

    def cancel_load(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)

    def request_finished(self, req: ConnectorRequest, params: dict[str, Any] | None, finished_ok: bool,
                         block_ids: list[list[int]], now: float) -> tuple[bool, dict[str, Any] | None]:
        self._lookups.pop(req.request_id, None)
        self._counted.discard(req.request_id)
        return False, None

    def expired_sends(self, now: float) -> list[str]:
        return []

    @property
    def has_unsent_stores(self) -> bool:
        """Blocks released since the last step's metadata: the worker side has not copied them out yet."""
        return bool(self._new_stores)

    def has_pending_work(self) -> bool:
        return bool(self._loading or self._new_loads or self._new_stores or self._storing)

    # -- KV events ---------------------------------------------------------------------------------------------


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.debug("KV tier: could not remove %s: %s", path, e)
