"""Architecture name (config.json ``architectures[0]``) -> model class. New families register here.

Every class is checked against the model contract (``models/interface.py``) when it is resolved: one that does not
inherit ``CausalLM``, lacks a required method or declares a capability of the wrong type is a ``TypeError`` naming
it. What a class supports is then read from it as plain attributes (``supported_quantization``, ...)."""
from __future__ import annotations

import importlib

from openinfer.config import ParallelConfig
from openinfer.models.interface import (CausalLM, MTPLayer, check_model_class, check_mtp_class,
                                        parallel_modes)

# Lazy imports keep start-up cheap and let a family's module fail without breaking the others.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("openinfer.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("openinfer.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("openinfer.models.llama", "Qwen3ForCausalLM"),
    "DeepseekV4ForCausalLM": ("openinfer.models.deepseek_v4", "DeepseekV4ForCausalLM"),
    "DeepseekV41ForCausalLM": ("openinfer.models.deepseek_v41", "DeepseekV41ForCausalLM"),
    "DeepseekV3ForCausalLM": ("openinfer.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    # GGUF files name llama.cpp's architecture (gguf_file.py writes "gguf:<general.architecture>")
    "gguf:llama": ("openinfer.models.llama", "LlamaForCausalLM"),
    "gguf:qwen2": ("openinfer.models.llama", "Qwen2ForCausalLM"),
    "gguf:qwen3": ("openinfer.models.llama", "Qwen3ForCausalLM"),
}


def register_model(architecture: str, module: str, cls_name: str) -> None:
    """Add (or replace) an architecture; its class is imported and checked when first resolved."""
    _MODELS[architecture] = (module, cls_name)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


# The architectures whose vision tower openinfer builds (deepseek_v41/vision.py): images are placed for these only.
IMAGE_ARCHITECTURES = frozenset({"DeepseekV41ForCausalLM"})


def resolve_model_class(architecture: str) -> type[CausalLM]:
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}"
        )
    module, cls_name = _MODELS[architecture]
    cls = vars(importlib.import_module(module)).get(cls_name)
    if cls is None:
        raise TypeError(f"architecture {architecture!r} is registered as {module}.{cls_name}, which does not exist")
    return check_model_class(cls)


def uses_dspark(architecture: str) -> bool:
    """Speculative method "mtp" drafts with DSpark blocks loaded with the target (``DSparkTarget``)."""
    return resolve_model_class(architecture).drafts_with_dspark


def mtp_architectures() -> list[str]:
    """Architectures that speculative method "mtp" runs on (an MTP layer class or DSpark draft blocks)."""
    out = []
    for arch in supported_architectures():
        try:
            cls = resolve_model_class(arch)
        except (ImportError, TypeError):  # a family that fails to import is reported when it is asked for
            continue
        if cls.drafts_with_dspark or cls.mtp_layer_class() is not None:
            out.append(arch)
    return out


def resolve_mtp_class(architecture: str) -> type[MTPLayer]:
    mtp = resolve_model_class(architecture).mtp_layer_class()
    if mtp is None:
        raise ValueError(f"speculative_config.method='mtp' is not available for {architecture!r}; MTP layers are "
                         f"supported for {', '.join(mtp_architectures())}")
    return check_mtp_class(mtp)


def check_parallel(architecture: str, parallel: ParallelConfig) -> None:
    """A ``ValueError`` naming the setting when ``parallel`` uses a mode the architecture's class does not list in
    ``supported_parallel_modes``."""
    cls = resolve_model_class(architecture)
    for mode, setting in parallel_modes(parallel).items():
        if mode not in cls.supported_parallel_modes:
            ok = sorted(m.value for m in cls.supported_parallel_modes)
            raise ValueError(f"{setting}: {architecture} does not support {mode.value} parallelism; it supports "
                             f"{', '.join(ok) or 'none'}")
