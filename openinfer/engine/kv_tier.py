"""Starting the offloading tier (``--kv-offloading-size``): which KV groups it can hold, its folder, its fingerprint,
and both sides of its connector. Pure Python (the worker side is started through the executor).

The tier holds a block position as one file with every group's block at that position, so it serves models whose
groups all have ordinary whole-life blocks (dense attention, MLA latent caches, a draft model's groups). A group
with larger blocks (DeepSeek-V4's compressed entries) or a sliding window (V4's window state, sliding-window
attention) has no block at every position to store, and a hit needs that group's state too: for such models the
tier stays off, said once at start-up, and prefixes evicted from the pool are recomputed.
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from openinfer.config import EngineConfig
from openinfer.distributed.kv_transfer.offload_scheduler import OffloadingConnectorScheduler
from openinfer.distributed.kv_transfer.tier_files import tier_fingerprint
from openinfer.engine.block_pool import ROOT_HASH
from openinfer.kv_cache_interface import KVGroupSpec

logger = logging.getLogger(__name__)

# A file's bytes beyond its payload: magic, lengths, CRC and the header (token ids of one block, hashes).
_HEADER_ALLOWANCE = 4096


def unsupported_groups(specs: list[KVGroupSpec], block_size: int) -> list[str]:
    """The groups the tier cannot hold block by block, with why."""
    out = []
    for s in specs:
        if s.sliding:
            out.append(f"{s.name} (sliding, {s.lookback_tokens}-token lookback)")
        elif s.tokens_per_block(block_size) != block_size:
            out.append(f"{s.name} ({s.tokens_per_block(block_size)}-token blocks)")
    return out


def make_offloading_connector(config: EngineConfig, specs: list[KVGroupSpec],
                              executor) -> tuple[OffloadingConnectorScheduler | None, str | None]:
    """(the scheduler side, or None when this model's groups keep the tier off; a temporary folder to remove at
    shutdown, when no path was given). Raises ValueError when the size cannot hold one block."""
    off, bs = config.kv_offload, config.cache.block_size
    bad = unsupported_groups(specs, bs)
    if bad:
        logger.warning("KV tier off for this model: its KV groups %s are not block-addressable by the tier (not "
                       "offloaded: prefixes evicted from the pool are recomputed)", ", ".join(bad))
        return None, None
    need = sum(s.bytes_per_block for s in specs) + _HEADER_ALLOWANCE
    if off.size_bytes < need:
        raise ValueError(f"kv_offloading_size={off.size_gb} GiB cannot hold one KV block of this model "
                         f"({need} bytes with its header); raise it")
    tmpdir = None
    base = off.path
    if base is None:
        base = tmpdir = tempfile.mkdtemp(prefix="openinfer-kv-tier-")
    fingerprint = tier_fingerprint(config, specs, [s.name for s in specs])
    directory = Path(base) / fingerprint[:16]
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"kv_offloading_path={base!r}: cannot make the tier's folder: {e.strerror or e}") from None
    info = executor.collective_rpc("init_kv_offload", (str(directory), fingerprint))[0]
    want = sum(s.bytes_per_block for s in specs)
    if info["payload_bytes"] != want:
        raise RuntimeError(f"KV tier: the worker's stores hold {info['payload_bytes']} bytes per block, the groups "
                           f"declare {want}")
    connector = OffloadingConnectorScheduler(off, directory, fingerprint, bs, ROOT_HASH)
    logger.info("KV tier: %s, up to %.2f GiB in %s%s", off.backend, off.size_gb, directory,
                " (temporary)" if tmpdir else "")
    return connector, tmpdir
