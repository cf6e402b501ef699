"""Build a model from an HF-format directory: registry lookup, safetensors tensors (never pickle), dtype."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from openinfer.config import AttentionBackend, ModelConfig
from openinfer.models.gguf_weights import iterate_gguf_weights
from openinfer.models.interface import CausalLM, MTPLayer
from openinfer.models.registry import resolve_model_class, resolve_mtp_class
from openinfer.layers.checkpoint_quant import QuantizedTensorGrouper
from openinfer.layers.linear import num_parameters
from openinfer.layers.weight_utils import CheckpointTensor, WeightLoadError

logger = logging.getLogger(__name__)


def safetensors_files(path: str | Path) -> list[Path]:
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightLoadError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted({p / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(f"shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(p.glob("*.safetensors"))
    if not files:
        bins = list(p.glob("*.bin")) + list(p.glob("*.pt"))
        hint = " (pickle .bin/.pt checkpoints are not loaded for safety; convert to safetensors)" if bins else ""
        raise WeightLoadError(f"no *.safetensors files in {str(p)!r}{hint}")
    return files


def iterate_weights(path: str | Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of the checkpoint, lazily: nothing is read until the model materializes it or narrows it to
    its tensor-parallel shard (layers/weight_utils.py)."""
    for f in safetensors_files(path):
        try:
            handle = safe_open(str(f), framework="pt", device="cpu")
            names = list(handle.keys())
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise WeightLoadError(f"cannot read {f.name}: {e} (file truncated or corrupt?)") from None
        for name in names:
            try:
                tensor = CheckpointTensor(handle, name, f.name)
            except Exception as e:
                raise WeightLoadError(f"cannot read tensor {name!r} from {f.name}: {e} "
                                      "(file truncated or corrupt?)") from None
            yield name, tensor


def checkpoint_weights(mc: ModelConfig) -> Iterator[tuple[str, object]]:
    """``iterate_weights`` (or a GGUF file's tensors), with a low-bit checkpoint's linears (compressed-tensors, GPTQ) gathered into
    ``QuantizedWeight``\\ s that stay packed (layers/checkpoint_quant.py)."""
    if mc.gguf_file is not None:  # llama.cpp's format: quantized tensors stay packed (models/gguf_weights.py)
        return iterate_gguf_weights(mc.hf_config, mc.dtype)
    cq = mc.checkpoint_quantization
    if cq is None:
        return iterate_weights(mc.path)
    return QuantizedTensorGrouper(cq, mc.dtype).convert(iterate_weights(mc.path))


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read (converters and tests; the engine reads lazily)."""
    return {name: t.load() for name, t in iterate_weights(path)}


def load_model(mc: ModelConfig, attention_backend: AttentionBackend = AttentionBackend.SDPA,
               device: torch.device | None = None) -> CausalLM:
    """Build the registered class for the checkpoint's architecture (in its dtype, on ``device``, by default the
    config's) and fill it from the safetensors files. The model follows ``models/interface.py``."""
    cls = resolve_model_class(mc.architecture)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(mc.dtype)
    try:
        with torch.device(device or mc.device):
            model = cls(mc.hf_config, attention_backend=attention_backend)
    finally:
        torch.set_default_dtype(prev)
    model.load_weights(checkpoint_weights(mc))
    model.eval()
    n = num_parameters(model)  # a low-bit checkpoint's linears hold their weights outside parameters
    logger.info("loaded %s (%.1fM params, %s) from %s", mc.architecture, n / 1e6, mc.dtype, mc.path)
    return model


def load_mtp_layer(mc: ModelConfig, index: int, attention_backend: AttentionBackend = AttentionBackend.SDPA,
                   device: torch.device | None = None, target: CausalLM | None = None) -> MTPLayer:
    """The checkpoint's multi-token-prediction layer ``index`` (speculative decoding's drafter), built and filled
    like a model (only its own tensors are read), or, for families that load it with the target (V4), taken
    from the loaded ``target``."""
    cls = resolve_mtp_class(mc.architecture)
    if cls.shares_target:
        return cls(target, index)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(mc.dtype)
    try:
        with torch.device(device or mc.device):
            layer = cls(mc.hf_config, index, attention_backend=attention_backend)
    finally:
        torch.set_default_dtype(prev)
    layer.load_weights(iterate_weights(mc.path))
    layer.eval()
    logger.info("loaded MTP layer %d of %s (%.1fM params)", index, mc.architecture,
                sum(p.numel() for p in layer.parameters()) / 1e6)
    return layer
