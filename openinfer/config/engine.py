"""The whole engine config, and its JSON form (what a worker process is started with)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from openinfer.config.cache import CacheConfig, KVOffloadConfig
from openinfer.config.kv_transfer import KVTransferConfig
from openinfer.config.model import AttentionBackend, KernelConfig, ModelConfig
from openinfer.config.parallel import ParallelConfig
from openinfer.config.scheduler import SchedulerConfig
from openinfer.config.speculative import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    """Built from ``EngineArgs.create_engine_config`` (engine_args.py), the one list of user settings."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    seed: int = 0
    attention_backend: AttentionBackend = AttentionBackend.SDPA
    structured_outputs_backend: str = "auto"  # auto | llguidance | xgrammar
    tokenizer_mode: str = "auto"  # auto (the chat template) | deepseek_v4 (chat_encoding/deepseek_v4.py)
    kv_transfer: KVTransferConfig | None = None
    kernel: KernelConfig = field(default_factory=KernelConfig)
    # Where the default sampling settings come from (vLLM's --generation-config): "auto" = the checkpoint's
    # generation_config.json, "vllm" = none (SamplingParams' own defaults), else a folder holding one.
    generation_config: str = "auto"
    kv_offload: KVOffloadConfig | None = None

    def __post_init__(self) -> None:
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(f"generation_config={self.generation_config!r}: give auto, vllm or a folder holding a "
                             f"generation_config.json")
        if not isinstance(self.attention_backend, AttentionBackend):
            raise ValueError(f"attention_backend must be an AttentionBackend, got {self.attention_backend!r} "
                             f"(AttentionBackend.parse reads 'auto', 'sdpa', 'reference')")
        if self.structured_outputs_backend not in ("auto", "llguidance", "xgrammar"):
            raise ValueError(f"structured_outputs_backend={self.structured_outputs_backend!r}; choose one of auto, "
                             f"llguidance, xgrammar")
        if self.tokenizer_mode not in ("auto", "deepseek_v4", "deepseek_v32"):
            raise ValueError(f"tokenizer_mode={self.tokenizer_mode!r}; choose one of auto, deepseek_v4, deepseek_v32")
        heads, tp = self.model.hf_config.get("num_attention_heads"), self.parallel.tensor_parallel_size
        if isinstance(heads, int) and heads % tp:  # as vLLM checks it: before any rank process starts
            raise ValueError(f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp}")
        if self.kv_transfer is not None:
            # Every rank runs its own connector worker side (its NIXL agent over its shard); the engine combines
            # their reports. Under external_launcher each rank is an engine of its own: nobody combines them.
            if self.parallel.executor_backend == "external_launcher":
                raise ValueError("kv_transfer_config with distributed_executor_backend='external_launcher' is not "
                                 "supported: use mp or ray (one engine drives every rank's connector)")
        if self.kv_offload is not None:
            # Any layout: tensor-parallel ranks store their own shards, data-parallel replicas keep their own
            # index, a drafter's KV groups go with the target's (engine/kv_tier.py).
            if not self.cache.enable_prefix_caching:
                raise ValueError("kv_offloading_size needs enable_prefix_caching: the tier is keyed by the prefix "
                                 "cache's block hashes")


def engine_config_to_json(config: EngineConfig) -> str:
    """The whole config as JSON (what a worker process is started with: no pickle crosses the boundary)."""
    m = config.model
    return json.dumps({
        "model": {"path": m.path, "hf_config": m.hf_config, "dtype": str(m.dtype).removeprefix("torch."),
                  "device": str(m.device), "max_model_len": m.max_model_len, "tokenizer_path": m.tokenizer_path,
                  "quantization": m.quantization},
        "cache": asdict(config.cache), "scheduler": asdict(config.scheduler), "parallel": asdict(config.parallel),
        "speculative": asdict(config.speculative) if config.speculative else None,
        "seed": config.seed, "attention_backend": config.attention_backend.value,
        "structured_outputs_backend": config.structured_outputs_backend, "tokenizer_mode": config.tokenizer_mode,
        "kv_transfer": asdict(config.kv_transfer) if config.kv_transfer else None,
        "kernel": asdict(config.kernel), "generation_config": config.generation_config,
        "kv_offload": asdict(config.kv_offload) if config.kv_offload else None,
    })


def engine_config_from_json(text: str) -> EngineConfig:
    import torch

    d = json.loads(text)
    m = d["model"]
    model = ModelConfig(path=m["path"], hf_config=m["hf_config"], dtype=getattr(torch, m["dtype"]),
                        device=torch.device(m["device"]), max_model_len=m["max_model_len"],
                        tokenizer_path=m["tokenizer_path"], quantization=m.get("quantization"))
    return EngineConfig(model=model, cache=CacheConfig(**d["cache"]), scheduler=SchedulerConfig(**d["scheduler"]),
                        parallel=ParallelConfig(**d["parallel"]),
                        speculative=SpeculativeConfig.parse(d.get("speculative")), seed=d["seed"],
                        attention_backend=AttentionBackend(d["attention_backend"]),
                        structured_outputs_backend=d.get("structured_outputs_backend", "auto"),
                        tokenizer_mode=d.get("tokenizer_mode", "auto"),
                        kv_transfer=KVTransferConfig.parse(d.get("kv_transfer")),
                        kernel=KernelConfig(**d["kernel"]) if d.get("kernel") else KernelConfig(),
                        generation_config=d.get("generation_config", "auto"),
                        kv_offload=KVOffloadConfig(**d["kv_offload"]) if d.get("kv_offload") else None)
