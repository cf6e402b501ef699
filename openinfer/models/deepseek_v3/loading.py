"""Checkpoint names -> DeepseekV3ForCausalLM parameters, as transformers writes them and as DeepSeek releases
them: per-expert tensors go into the stacked expert weights, HF's separate gate/up into the fused
``gate_up_proj``, FP8 block-quantised weights are paired with their scales and either kept packed (the linears
``packs_fp8`` accepts, as ``Fp8Weight``) or dequantised (models/quantized_weights.py), and MTP layers
(``model.layers.{num_hidden_layers}.*``) are skipped."""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from openinfer.layers.deepseek_moe import DeepseekExperts
from openinfer.layers.quant_linear import QuantizedWeight
from openinfer.models.quantized_weights import Dequantizer, packs_fp8, scale_owner
from openinfer.models.weights import WeightLoadError, copy_into

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"((?:.+\.)?mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def checkpoint_tensor_names(model: nn.Module) -> set[str]:
    """Every tensor name an HF checkpoint must contain for this rank (per-expert, unfused names; with expert
    parallelism only the experts this rank holds)."""
    names: set[str] = set()
    for pname, _ in model.named_parameters():
        if pname.endswith(".experts.w13_weight") or pname.endswith(".experts.w2_weight"):
            prefix, kind = pname.rsplit(".", 1)
            experts = model.get_submodule(prefix)
            projs = ("gate_proj", "up_proj") if kind == "w13_weight" else ("down_proj",)
            names.update(f"{prefix}.{e}.{proj}.weight" for e in experts.expert_ids for proj in projs)
        elif ".gate_up_proj." in pname:
            names.update(pname.replace(".gate_up_proj.", f".{p}.") for p in ("gate_proj", "up_proj"))
        else:
            names.add(pname)
    return names


def load_v3_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    args = model.args
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    dequantizer = Dequantizer(args.fp8_block, None, lambda n: n in params,
                              keep_packed=lambda n: _keeps_fp8(model, n, args.fp8_block))
    mtp = 0
    for raw_name, raw_tensor in weights:
        m = _LAYER.match(raw_name)
        if m and int(m.group(1)) >= args.num_hidden_layers:
            mtp += 1
            continue
        if "rotary_emb.inv_freq" in raw_name or (args.tie_word_embeddings and raw_name == "lm_head.weight"):
            continue
        if _not_this_ranks_expert(model, raw_name):
            continue  # expert parallelism: another rank holds it (and reads it)
        for name, tensor in dequantizer.feed(raw_name, raw_tensor):
            _load_one(model, params, name, tensor)
            loaded.add(name)
    dequantizer.finish()
    if mtp:
        logger.info("skipping %d MTP tensors (model.layers.%d.*): speculative_config method 'mtp' loads them",
                    mtp, args.num_hidden_layers)
    missing = checkpoint_tensor_names(model) - loaded
    if missing:
        raise WeightLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
    return loaded


def _experts_of(model: nn.Module, name: str) -> tuple[DeepseekExperts, int, str] | None:
    """(the experts module, expert id, projection) for a routed expert's tensor name (or its scale), else None."""
    m = _EXPERT.match(scale_owner(name) or name)
    if not m:
        return None
    experts = _submodule(model, m.group(1), name)
    if not isinstance(experts, DeepseekExperts) or not 0 <= int(m.group(2)) < experts.num_experts:
        raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model")
    return experts, int(m.group(2)), m.group(3)


def _not_this_ranks_expert(model: nn.Module, name: str) -> bool:
    found = _experts_of(model, name)
    return found is not None and found[1] not in found[0].expert_ids


def _keeps_fp8(model: nn.Module, name: str, block: tuple[int, int] | None) -> bool:
    """Whether the FP8 weight ``name`` stays packed: its experts module chose to at construction, a linear if
    ``packs_fp8`` accepts it."""
    found = _experts_of(model, name)
    if found is not None:
        return found[0].fp8_block is not None
    return packs_fp8(_linear_of(model, name), block)


def _linear_of(model: nn.Module, name: str) -> nn.Module | None:
    """The module a (non-expert) ``X.weight`` loads into: HF's gate / up into the fused ``gate_up_proj``."""
    if _experts_of(model, name) is not None:
        return None
    path = name.rpartition(".")[0]
    for proj in (".gate_proj", ".up_proj"):
        if path.endswith(proj):
            path = path[:-len(proj)] + ".gate_up_proj"
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _load_one(model: nn.Module, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    found = _experts_of(model, name)
    if found is not None:
        experts, e, proj = found
        experts.load_expert(e, {"gate_proj": 0, "up_proj": 1, "down_proj": 2}[proj], tensor)
        return
    if isinstance(tensor, QuantizedWeight):  # an FP8 linear kept packed (packs_fp8 chose this module)
        part = 0 if ".gate_proj." in name else (1 if ".up_proj." in name else None)
        try:
            _linear_of(model, name).load_quantized(tensor, part)
        except ValueError as e:
            raise WeightLoadError(f"checkpoint tensor {name!r}: {e}") from None
        return
    for proj, part in ((".gate_proj.", 0), (".up_proj.", 1)):
        if proj in name:  # dense MLP / shared experts: HF's gate and up fill parts of gate_up_proj
            fused = params.get(name.replace(proj, ".gate_up_proj."))
            if fused is None:
                raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model")
            fused.weight_loader(fused, tensor, part)
            return
    if name not in params:
        raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model")
    param = params[name]
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, tensor)
    else:
        copy_into(param, tensor, name)


def _submodule(model: nn.Module, path: str, name: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model") from None
