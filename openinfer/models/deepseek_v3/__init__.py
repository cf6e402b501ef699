"""DeepSeek-V3 / R1: config, MLA attention, model and checkpoint loading, one file each."""
from openinfer.models.deepseek_v3.model import DeepseekV3ForCausalLM

__all__ = ["DeepseekV3ForCausalLM"]
