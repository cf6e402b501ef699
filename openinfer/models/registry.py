"""Architecture name (config.json ``architectures[0]``) -> model class. New families register here."""
from __future__ import annotations

import importlib

from torch import nn

# Lazy imports keep start-up cheap and let a family's module fail without breaking the others.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("openinfer.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("openinfer.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("openinfer.models.llama", "Qwen3ForCausalLM"),
    "DeepseekV4ForCausalLM": ("openinfer.models.deepseek_v4", "DeepseekV4ForCausalLM"),
    "DeepseekV41ForCausalLM": ("openinfer.models.deepseek_v41", "DeepseekV41ForCausalLM"),
    "DeepseekV3ForCausalLM": ("openinfer.models.deepseek_v3", "DeepseekV3ForCausalLM"),
}


# Architecture -> its multi-token-prediction layer (speculative_config method "mtp").
_MTP: dict[str, tuple[str, str]] = {
    "DeepseekV3ForCausalLM": ("openinfer.models.deepseek_v3.mtp", "DeepseekV3MTP"),
    "DeepseekV4ForCausalLM": ("openinfer.models.deepseek_v4.mtp", "DeepseekV4MTP"),
}


# Architectures whose MTP layers are DSpark draft blocks (loaded with the target as ``model.mtp``): method "mtp"
# drafts a whole block per step with them (worker/proposers/dspark.py), as DeepInfer's MTP module does on V4.1.
_DSPARK = frozenset({"DeepseekV41ForCausalLM"})


def uses_dspark(architecture: str) -> bool:
    return architecture in _DSPARK


def resolve_mtp_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MTP:
        raise ValueError(f"speculative_config.method='mtp' is not available for {architecture!r}; MTP layers are "
                         f"supported for {', '.join(sorted(_MTP | dict.fromkeys(_DSPARK)))}")
    module, cls_name = _MTP[architecture]
    return getattr(importlib.import_module(module), cls_name)


def register_model(architecture: str, module: str, cls_name: str) -> None:
    _MODELS[architecture] = (module, cls_name)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}"
        )
    module, cls_name = _MODELS[architecture]
    return getattr(importlib.import_module(module), cls_name)
