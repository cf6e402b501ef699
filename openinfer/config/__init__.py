"""One typed configuration, built once by the entrypoint and passed down.

Users set engine settings through ``EngineArgs`` (engine_args.py, the one list); its ``create_engine_config``
builds these frozen dataclasses, which validate in ``__post_init__`` so that a bad value fails at construction
with a message naming the field, never deep inside a step. One section a file: the model and its kernels
(``model``), the KV cache and its second tier (``cache``), the scheduler's step (``scheduler``), the ranks
(``parallel``), speculative decoding (``speculative``), prefill/decode disaggregation (``kv_transfer``), and the
whole (``engine``); import them from here.
"""
from openinfer.config.cache import KV_CACHE_DTYPES, KV_OFFLOADING_BACKENDS, CacheConfig, KVOffloadConfig
from openinfer.config.engine import EngineConfig, engine_config_from_json, engine_config_to_json
from openinfer.config.kv_transfer import KV_CONNECTORS, KV_ROLES, KV_SEND_TYPES, KVTransferConfig
from openinfer.config.model import KERNEL_BACKENDS, AttentionBackend, KernelConfig, ModelConfig, resolve_dtype
from openinfer.config.parallel import EXECUTOR_BACKENDS, ParallelConfig
from openinfer.config.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from openinfer.config.speculative import SPECULATIVE_METHODS, SpeculativeConfig

__all__ = [
    "AttentionBackend", "CacheConfig", "EngineConfig", "EXECUTOR_BACKENDS", "KERNEL_BACKENDS", "KV_CACHE_DTYPES",
    "KV_CONNECTORS", "KV_OFFLOADING_BACKENDS", "KV_ROLES", "KV_SEND_TYPES", "KVOffloadConfig", "KVTransferConfig",
    "KernelConfig", "ModelConfig", "ParallelConfig", "SCHEDULING_POLICIES", "SPECULATIVE_METHODS", "SchedulerConfig",
    "SpeculativeConfig", "engine_config_from_json", "engine_config_to_json", "resolve_dtype",
]
