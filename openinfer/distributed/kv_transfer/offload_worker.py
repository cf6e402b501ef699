"""The offloading tier's worker side: copies blocks out of the KV stores into the tier's files and reads them back.

Each step, before the forward (``start_load_kv``): the blocks to store are gathered out of every store in one
``index_select`` per store (a copy, so the forward may overwrite the pool blocks right after) and handed to the
writer thread, which checksums and writes one file per block (tier_files.py); the loads are handed to the reader
thread, which reads, checks and copies each file into the request's fresh pool blocks. Neither thread touches a
block the step's forward reads or writes: a loading request is parked (never scheduled) and owns its blocks. Only
the gather runs on the step's thread; the disk never does.

Results come back through ``get_finished``: files written (chain hash -> bytes), reads done or failed (with the
entries found stale or corrupt), and the first failed write, after which nothing more is written.

Tensor parallel: every rank stores and reads its own shard (files named by rank). The ranks agree on what is over
before anything is reported: every rank gets the same metadata each step, so all know the same reads and store
batches in flight, and while any is, each ``get_finished`` gathers every rank's finished ones over the CPU group (a
collective all ranks of the group enter on the same step: never a deadlock). A read is reported once every rank's
is over - failed if any rank's failed, so no rank's blocks are still being written when the request resumes or
frees them - and a block is reported stored only once every rank wrote its file. The executor passes rank 0's
report on.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import torch

from openinfer.distributed.kv_transfer import tier_files
from openinfer.distributed.kv_transfer.base import KVConnectorWorker
from openinfer.distributed.kv_transfer.tier_files import TierFileError, TierHeader, file_name
from openinfer.distributed.kv_transfer.tier_store import TierStoreError, make_store
from openinfer.step_io import KVConnectorMetadata, KVConnectorOutput, TierBlock, TierLoad

logger = logging.getLogger(__name__)


class _Report(msgspec.Struct, array_like=True):
    """One rank's finished work since the last agreement: read results by request id (bytes, seconds, error, the
    entry to drop) and store batches by sequence number (blocks written, error)."""

    loads: dict[str, tuple[int, float, str, tuple[int, int] | None]] = {}
    stores: dict[int, tuple[list[tuple[int, int, int]], str]] = {}


class OffloadingConnectorWorker(KVConnectorWorker):
    def __init__(self, backend: str, location: str, fingerprint: str, group=None) -> None:
        """``group``: the tensor-parallel group (parallel_state.GroupCoordinator); None or one rank: this rank's
        files hold whole blocks."""
        self.store = make_store(backend, location, fingerprint)
        self.group = group
        self.tp = group.world_size if group is not None else 1
        self.rank = group.rank_in_group if self.tp > 1 else 0
        self._file_rank = self.rank if self.tp > 1 else None
        self.fingerprint = fingerprint
        self.rows: list[list[torch.Tensor]] = []  # per group: each store as [num_blocks, row bytes] uint8
        self.payload_bytes: list[int] = []  # per group: one block's bytes over its stores
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-store")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-load")
        self._stores: dict[int, Future] = {}  # store batch (numbered in metadata order, the same on every rank)
        self._next_store = 0
        self._loads: dict[str, Future] = {}
        self._done = _Report({}, {})  # finished here, not yet finished on every rank
        self._write_failed = False

    def register_kv_caches(self, groups: dict[str, list[torch.Tensor]]) -> dict:
        self.rows = [[t.view(t.shape[0], -1).view(torch.uint8) for t in ts] for ts in groups.values()]
        self.payload_bytes = [sum(r.shape[1] for r in g) for g in self.rows]
        return {"payload_bytes": self.payload_bytes}

    # -- stores -------------------------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if meta is None:
            return
        # Stores first: a block freed last step may be refilled by this step's loads or forward. A batch is
        # submitted even after a failed write (then empty): every rank numbers the same batches.
        if meta.tier_stores:
            jobs = []
            for gi, stores in enumerate(self.rows):
                blocks = [b for b in meta.tier_stores if b.group == gi]
                if blocks and not self._write_failed:
                    idx = torch.tensor([b.block_id for b in blocks], dtype=torch.long, device=stores[0].device)
                    jobs.append((blocks, [r.index_select(0, idx).cpu() for r in stores]))
            self._stores[self._next_store] = self._writer.submit(self._write, jobs)
            self._next_store += 1
        for load in meta.tier_loads:
            self._loads[load.req_id] = self._reader.submit(self._read, load)

    def _write(self, jobs: list[tuple[list[TierBlock], list[torch.Tensor]]]) -> tuple[list[tuple[int, int, int]], str]:
        """Writer thread: one file per block. Stops at the first failed write (reported: the tier turns off)."""
        written: list[tuple[int, int, int]] = []
        if self._write_failed:
            return written, ""
        for blocks, snaps in jobs:
            for j, b in enumerate(blocks):
                payload = b"".join(s[j].numpy() for s in snaps)
                header = TierHeader(self.fingerprint, b.group, b.block_hash, b.parent_hash, b.token_ids,
                                    len(payload), self.rank)
                try:
                    n = self.store.put(file_name(b.group, b.block_hash, self._file_rank),
                                       tier_files.encode(header, payload))
                except OSError as e:
                    self._write_failed = True
                    return written, f"{type(e).__name__}: {e}"
                written.append((b.group, b.block_hash, n))
        return written, ""

    # -- loads --------------------------------------------------------------------------------------------------
    def _read(self, load: TierLoad) -> tuple[int, float, str, tuple[int, int] | None]:
        """Reader thread: (bytes read, seconds, error, the entry to drop). Copies each checked block into its pool
        blocks; the first bad file fails the whole read (the scheduler recomputes the prompt)."""
        t0 = time.monotonic()
        n = 0
        for b in load.blocks:
            name = file_name(b.group, b.block_hash, self._file_rank)
            try:
                payload = tier_files.read_block(self.store.open(name), self.fingerprint, b.group, b.block_hash,
                                                b.parent_hash, b.token_ids, self.payload_bytes[b.group], self.rank)
            except TierStoreError as e:  # the store, not the entry: nothing to drop
                return n, time.monotonic() - t0, f"{name}: {e}", None
            except (OSError, TierFileError) as e:
                return n, time.monotonic() - t0, f"{name}: {e}", (b.group, b.block_hash)
            data = torch.frombuffer(payload, dtype=torch.uint8)
            off = 0
            for r in self.rows[b.group]:
                k = r.shape[1]
                r[b.block_id].copy_(data[off:off + k])
                off += k
            n += len(payload)
        return n, time.monotonic() - t0, "", None

    def get_finished(self) -> KVConnectorOutput:
        for seq in [q for q, fut in self._stores.items() if fut.done()]:
            try:
                self._done.stores[seq] = self._stores.pop(seq).result()
            except Exception as e:  # a bug: the tier turns itself off
                logger.exception("KV tier: writing blocks failed")
                self._done.stores[seq] = ([], f"{type(e).__name__}: {e}")
        for rid in [rid for rid, fut in self._loads.items() if fut.done()]:
            try:
                self._done.loads[rid] = self._loads.pop(rid).result()
            except Exception as e:  # a bug, not a bad file: recompute all the same
                logger.exception("KV tier: reading request %s's prefix failed", rid)
                self._done.loads[rid] = (0, 0.0, f"{type(e).__name__}: {e}", None)
        out = KVConnectorOutput()
        if not (self._done.loads or self._done.stores or self._loads or self._stores):
            return out  # nothing in flight on any rank (all know the same work): no collective this step
        reports = self._agree()
        for seq in sorted(set.intersection(*(set(r.stores) for r in reports))):
            done = [r.stores[seq] for r in reports]
            self._done.stores.pop(seq)
            # Every rank's file of a block, or the block is not stored (bytes: all ranks' files).
            written = [{(g, h): n for g, h, n in w} for w, _ in done]
            for g, h, _ in done[0][0]:
                if all((g, h) in w for w in written):
                    out.tier_stored.append((g, h, sum(w[(g, h)] for w in written)))
            err = next((e for _, e in done if e), "")
            if err and not out.tier_store_error:
                out.tier_store_error = err
        for rid in sorted(set.intersection(*(set(r.loads) for r in reports))):
            done = [r.loads[rid] for r in reports]
            self._done.loads.pop(rid)
            out.tier_bytes_loaded += sum(d[0] for d in done)
            out.tier_load_seconds += max(d[1] for d in done)
            err = next((d[2] for d in done if d[2]), "")
            if err:
                out.failed_recving[rid] = err
                out.tier_invalid += sorted({tuple(d[3]) for d in done if d[3] is not None})
            else:
                out.finished_recving.append(rid)
        return out

    def _agree(self) -> list[_Report]:
        """Every rank's finished work (this rank's alone with one rank)."""
        if self.tp == 1:
            return [self._done]
        data = self.group.all_gather_bytes(msgspec.msgpack.encode(self._done))
        return [msgspec.msgpack.decode(d, type=_Report) for d in data]

    def shutdown(self) -> None:
        """Finish the writes in flight (their files are complete or absent, never half written)."""
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
