"""Where the offloading tier's blocks live: a folder of this instance's (``native``), or a Redis / Valkey server that
several instances share (``redis``). Both hold the same bytes per block (tier_files.py: header, CRC, payload) under
the same name, so integrity checks and keys are one code path. Pure Python (no torch).

The shared store is an existing server, not a home-made one: blocks are Redis strings under
``openinfer-kv:<fingerprint>:<name>`` (the name is the chain hash KV events publish, and the group), so any instance
of the same model and settings reuses a prefix another computed. The server's own memory policy evicts (run it with
``maxmemory`` and ``maxmemory-policy allkeys-lru``); openinfer never reconfigures a shared server.
"""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import BinaryIO

from openinfer.distributed.kv_transfer import tier_files

# How long one request to the shared store may take before it counts as unreachable (a lookup runs on the engine's
# step: a dead store must cost a bounded pause, once, before the tier turns itself off).
STORE_TIMEOUT_S = 2.0


class TierStoreError(OSError):
    """The store could not be reached or refused the operation."""


class DirStore:
    """One file per block in a local folder (this instance's: its index is rebuilt from the files at start)."""

    shared = False

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __str__(self) -> str:
        return str(self.directory)

    def put(self, name: str, parts: list) -> int:
        return tier_files.write_block(self.directory / name, parts)

    def open(self, name: str) -> BinaryIO:
        return open(self.directory / name, "rb")

    def remove(self, name: str) -> None:
        try:
            os.unlink(self.directory / name)
        except FileNotFoundError:
            pass

    def exists(self, names: list[str]) -> list[bool]:
        return [(self.directory / n).exists() for n in names]


class RedisStore:
    """Blocks as Redis / Valkey strings, shared by every instance of the same model and settings."""

    shared = True

    def __init__(self, url: str, fingerprint: str) -> None:
        import redis

        self._errors = (redis.RedisError, OSError)
        self.url = url
        self.prefix = f"openinfer-kv:{fingerprint[:16]}:"
        self.client = redis.Redis.from_url(url, socket_timeout=STORE_TIMEOUT_S,
                                           socket_connect_timeout=STORE_TIMEOUT_S)

    def __str__(self) -> str:
        return self.url

    def ping(self) -> None:
        try:
            self.client.ping()
        except self._errors as e:
            raise TierStoreError(f"{type(e).__name__}: {e}") from None

    def put(self, name: str, parts: list) -> int:
        data = b"".join(parts)
        try:
            self.client.set(self.prefix + name, data)
        except self._errors as e:
            raise TierStoreError(f"{type(e).__name__}: {e}") from None
        return len(data)

    def open(self, name: str) -> BinaryIO:
        try:
            data = self.client.get(self.prefix + name)
        except self._errors as e:
            raise TierStoreError(f"{type(e).__name__}: {e}") from None
        if data is None:  # evicted by the server, or never there
            raise FileNotFoundError(name)
        return io.BytesIO(data)

    def remove(self, name: str) -> None:
        try:
            self.client.delete(self.prefix + name)
        except self._errors:
            pass  # the server evicts it in time; a dead store is reported by the next lookup or write

    def exists(self, names: list[str]) -> list[bool]:
        """One round trip for all of them."""
        if not names:
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                pipe.exists(self.prefix + n)
            return [bool(x) for x in pipe.execute()]
        except self._errors as e:
            raise TierStoreError(f"{type(e).__name__}: {e}") from None


def make_store(backend: str, location: str, fingerprint: str) -> DirStore | RedisStore:
    if backend == "redis":
        return RedisStore(location, fingerprint)
    return DirStore(Path(location))
