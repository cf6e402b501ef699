"""DeepSeek-V4 (V4-Flash): mHC residual streams, SWA / CSA / HCA compressed attention with a lightning indexer,
sqrtsoftplus MoE with hash-routed first layers. Split by concept (config, hc, attention, compressor, indexer,
moe, cache, model, loading); see each module's docstring and specs/deepseek_v4.md."""
from openinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

__all__ = ["DeepseekV4ForCausalLM"]
