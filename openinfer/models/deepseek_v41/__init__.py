"""DeepSeek-V4.1 (DeepInfer 0.1.0's only model): V4 with C1/C2 compression, cross-layer KV / indexer sharing,
YOCO, candidate blocks, shifted mHC, Engram and hash-free MoE, and its vision tower. One concept per module (config,
topology, compression, indexer, hc, engram, moe, attention, cache, model, loading, reference; vision, vision_inputs,
vision_names: docs/vision.md); spec §7."""
from openinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM

__all__ = ["DeepseekV41ForCausalLM"]
