"""Starting the offloading tier (``--kv-offloading-size``): its folder, its fingerprint, the groups' policies it
needs, and both sides of its connector. Pure Python (the worker side is started through the executor).

The store is a local folder (``native``) or a Redis / Valkey server that instances share (``redis``, tier_store.py).

Every KV group kind goes through it, one file per group block: full attention and MLA latent caches (whole-life,
every block), sliding windows and DeepSeek-V4's window state (only the blocks a hit's first recomputed query reads:
the last window before it), DeepSeek-V4's compressed entries and index keys in larger blocks (keyed like the pool:
by the last ordinary block a group block covers). What a model keeps outside its KV stores is not offloaded; the
stores are the whole per-sequence state of every model here (the NIXL connector moves the same ones).

Data parallel: each replica has its own pool, so its own scheduler side and index; on a local disk its own folder
(``dp<r>`` under the fingerprint's), on a shared store the same keys (replicas hold the same shards), so a prefix
one replica computed serves the others.
"""
from __future__ import annotations

import logging
import tempfile
from dataclasses import replace
from pathlib import Path

from openinfer.config import EngineConfig
from openinfer.distributed.kv_transfer.offload_scheduler import OffloadingConnectorScheduler, TierGroup
from openinfer.distributed.kv_transfer.tier_files import tier_fingerprint
from openinfer.distributed.kv_transfer.tier_store import DirStore, RedisStore, TierStoreError
from openinfer.engine.block_pool import ROOT_HASH
from openinfer.kv_cache_interface import KVGroupSpec

logger = logging.getLogger(__name__)

# A file's bytes beyond its payload: magic, lengths, CRC and the header (token ids of one block, hashes).
_HEADER_ALLOWANCE = 4096


def make_offloading_connectors(config: EngineConfig, specs: list[KVGroupSpec],
                               executor) -> tuple[list[OffloadingConnectorScheduler], str | None]:
    """(the scheduler side of each data-parallel replica, a temporary folder to remove at shutdown when no path was
    given). Raises ValueError when the size cannot hold one block or the folder cannot be made."""
    off, bs, dp = config.kv_offload, config.cache.block_size, config.parallel.data_parallel_size
    need = max(s.bytes_per_block for s in specs) + _HEADER_ALLOWANCE
    if off.size_bytes // dp < need:
        raise ValueError(f"kv_offloading_size={off.size_gb} GiB cannot hold one KV block of this model per "
                         f"data-parallel replica ({need} bytes with its header, {dp} replica(s)); raise it")
    fingerprint = tier_fingerprint(config, specs, [s.name for s in specs])
    tmpdir = None
    if off.backend == "redis":
        try:
            store = RedisStore(off.path, fingerprint)
        except ImportError:
            raise ValueError("kv_offloading_backend='redis' needs the redis client: pip install "
                             "'openinfer[kv-shared]'") from None
        try:
            store.ping()
        except TierStoreError as e:
            raise ValueError(f"kv_offloading_path={off.path!r}: cannot reach the shared KV store ({e})") from None
        stores, locations = [store] * dp, [off.path] * dp
    else:
        base = off.path
        if base is None:
            base = tmpdir = tempfile.mkdtemp(prefix="openinfer-kv-tier-")
        directory = Path(base) / fingerprint[:16]
        dirs = [directory] if dp == 1 else [directory / f"dp{r}" for r in range(dp)]
        try:
            for d in dirs:
                d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_offloading_path={base!r}: cannot make the tier's folder: {e.strerror or e}") \
                from None
        stores, locations = [DirStore(d) for d in dirs], [str(d) for d in dirs]
    # Each rank opens its replica's location.
    executor.collective_rpc("init_kv_offload", (off.backend, locations, fingerprint))
    groups = [TierGroup(s.tokens_per_block(bs) // bs, s.lookback_tokens, s.bytes_per_block > 0) for s in specs]
    # Each replica's share of the size (its own index of its own folder; on a shared store, what it remembers).
    sub = off if dp == 1 else replace(off, size_gb=off.size_gb / dp)
    connectors = [OffloadingConnectorScheduler(sub, st, fingerprint, bs, ROOT_HASH, groups,
                                               config.parallel.tensor_parallel_size) for st in stores]
    logger.info("KV tier: %s, %s in %s%s", off.backend,
                "shared, bounded by the store's own memory policy" if stores[0].shared
                else f"up to {off.size_gb:.2f} GiB", ", ".join(locations), " (temporary)" if tmpdir else "")
    return connectors, tmpdir
