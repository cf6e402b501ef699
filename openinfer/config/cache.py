"""The KV cache: its blocks, its dtype, prefix caching, and the second tier blocks go to (KV offloading)."""
from __future__ import annotations

import os
from dataclasses import dataclass


# fp8_e5m2 (vLLM's other fp8) is not offered: e4m3's extra mantissa bit is what a scale-1.0 cache wants.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla", "fp4", "mxfp8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Memory for the KV cache; None = derive from memory free after warm-up (see worker.Worker.determine_kv_budget).
    kv_cache_memory_gb: float | None = None
    # Fraction of free device memory used when kv_cache_memory_gb is unset.
    memory_utilization: float = 0.9
    # vLLM's --gpu-memory-utilization: the share of the device's whole memory this instance may use (weights,
    # activations and KV cache together); the KV cache gets what is left of it after warm-up. Overrides
    # memory_utilization when set (worker.kv_budget_for_utilization).
    gpu_memory_utilization: float | None = None
    # Exact block count (tests use it to force preemption); overrides the memory-based size.
    num_kv_blocks: int | None = None
    # What the cache stores (vLLM's names): "auto" = the model's dtype; "fp8" / "fp8_e4m3" = float8_e4m3fn with
    # scale 1.0 (layers/kv_quant.py); "fp8_ds_mla" = DeepSeek-V4's packed fp8 entry layout (what "fp8" selects
    # on V4 anyway); "fp4" / "mxfp8" = DeepSeek-V4.1's compressed KV in DeepInfer's FP4 / MXFP8 (on V4.1 "fp8" is
    # DeepInfer's choice from the config's use_fp4_sparse_kv; models/deepseek_v41/cache.py).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype != "auto"


# native: files in a local folder (--kv-offloading-path DIR); redis: a Redis / Valkey server that instances share
# (--kv-offloading-path redis://host:port[/db]; openinfer's addition to vLLM's choices).
KV_OFFLOADING_BACKENDS = ("native", "redis")


@dataclass(frozen=True)
class KVOffloadConfig:
    """A second KV tier (vLLM's ``--kv-offloading-backend`` / ``--kv-offloading-size``): full blocks that leave the
    pool are kept in files under ``path`` (openinfer's own flag; default: a temporary folder removed at shutdown),
    at most ``size_gb`` GiB, and a prompt whose prefix is there is loaded instead of recomputed
    (distributed/kv_transfer/offload_*.py). ``native``: files on a local disk (vLLM's native backend keeps CPU
    memory; a tmpfs path is that). ``redis``: a Redis / Valkey server at ``path`` (a redis:// URL) shared by every
    instance of the same model and settings; the server's own memory policy bounds it."""

    size_gb: float
    backend: str = "native"
    path: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(f"kv_offloading_backend={self.backend!r}; choose one of "
                             f"{', '.join(KV_OFFLOADING_BACKENDS)}")
        v = self.size_gb
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"kv_offloading_size must be a number of GiB > 0, got {v!r}")
        if self.backend == "redis" and not (self.path or "").startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_offloading_backend='redis' needs kv_offloading_path=redis://host:port[/db] (the "
                             f"shared store's address), got {self.path!r}")

    @property
    def size_bytes(self) -> int:
        return int(self.size_gb * (1 << 30))

    def check_path(self) -> None:
        """At start-up: the folder exists (or can be made) and files can be written there (ValueError naming
        --kv-offloading-path otherwise), so a bad path fails before the model loads, not at the first store."""
        if self.path is None or self.backend != "native":
            return  # a shared store is reached at engine start (a clear error if it cannot be)
        import tempfile

        try:
            os.makedirs(self.path, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.path, prefix=".probe-"):
                pass
        except OSError as e:
            raise ValueError(f"kv_offloading_path={self.path!r} is not a writable folder: {e.strerror or e}") \
                from None
