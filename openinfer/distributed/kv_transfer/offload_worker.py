"""The offloading tier's worker side: copies blocks out of the KV stores into the tier's files and reads them back.

Each step, before the forward (``start_load_kv``): the blocks to store are gathered out of every store in one
``index_select`` per store (a copy, so the forward may overwrite the pool blocks right after) and handed to the
writer thread, which checksums and writes one file per block (tier_files.py); the loads are handed to the reader
thread, which reads, checks and copies each file into the request's fresh pool blocks. Neither thread touches a
block the step's forward reads or writes: a loading request is parked (never scheduled) and owns its blocks. Only
the gather runs on the step's thread; the disk never does.

Results come back through ``get_finished``: files written (chain hash -> bytes), reads done or failed (with the
entries found stale or corrupt), and the first failed write, after which nothing more is written.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from openinfer.distributed.kv_transfer import tier_files
from openinfer.distributed.kv_transfer.base import KVConnectorWorker
from openinfer.distributed.kv_transfer.tier_files import TierFileError, TierHeader, file_name
from openinfer.distributed.kv_transfer.tier_store import TierStoreError, make_store
from openinfer.step_io import KVConnectorMetadata, KVConnectorOutput, TierBlock, TierLoad

logger = logging.getLogger(__name__)


class OffloadingConnectorWorker(KVConnectorWorker):
    def __init__(self, backend: str, location: str, fingerprint: str) -> None:
        self.store = make_store(backend, location, fingerprint)
        self.fingerprint = fingerprint
        self.rows: list[list[torch.Tensor]] = []  # per group: each store as [num_blocks, row bytes] uint8
        self.payload_bytes: list[int] = []  # per group: one block's bytes over its stores
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-store")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-load")
        self._stores: list[Future] = []
        self._loads: dict[str, Future] = {}
        self._write_failed = False

    def register_kv_caches(self, groups: dict[str, list[torch.Tensor]]) -> dict:
        self.rows = [[t.view(t.shape[0], -1).view(torch.uint8) for t in ts] for ts in groups.values()]
        self.payload_bytes = [sum(r.shape[1] for r in g) for g in self.rows]
        return {"payload_bytes": self.payload_bytes}

    # -- stores -------------------------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        if meta is None:
            return
        # Stores first: a block freed last step may be refilled by this step's loads or forward.
        if meta.tier_stores and not self._write_failed:
            jobs = []
            for gi, stores in enumerate(self.rows):
                blocks = [b for b in meta.tier_stores if b.group == gi]
                if blocks:
                    idx = torch.tensor([b.block_id for b in blocks], dtype=torch.long, device=stores[0].device)
                    jobs.append((blocks, [r.index_select(0, idx).cpu() for r in stores]))
            self._stores.append(self._writer.submit(self._write, jobs))
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
                                    len(payload))
                try:
                    n = self.store.put(file_name(b.group, b.block_hash), tier_files.encode(header, payload))
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
            name = file_name(b.group, b.block_hash)
            try:
                payload = tier_files.read_block(self.store.open(name), self.fingerprint, b.group, b.block_hash,
                                                b.parent_hash, b.token_ids, self.payload_bytes[b.group])
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
        out = KVConnectorOutput()
        pending = []
        for fut in self._stores:
            if not fut.done():
                pending.append(fut)
                continue
            written, err = fut.result()
            out.tier_stored += written
            if err:
                out.tier_store_error = err
        self._stores = pending
        for rid in [rid for rid, fut in self._loads.items() if fut.done()]:
            try:
                nbytes, secs, err, bad = self._loads.pop(rid).result()
            except Exception as e:  # a bug, not a bad file: recompute all the same
                logger.exception("KV tier: reading request %s's prefix failed", rid)
                nbytes, secs, err, bad = 0, 0.0, f"{type(e).__name__}: {e}", None
            out.tier_bytes_loaded += nbytes
            out.tier_load_seconds += secs
            if err:
                out.failed_recving[rid] = err
                if bad is not None:
                    out.tier_invalid.append(bad)
            else:
                out.finished_recving.append(rid)
        return out

    def shutdown(self) -> None:
        """Finish the writes in flight (their files are complete or absent, never half written)."""
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
