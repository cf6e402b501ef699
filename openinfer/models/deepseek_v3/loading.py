"""Checkpoint names -> DeepseekV3ForCausalLM parameters, as transformers writes them and as DeepSeek releases
them: per-expert tensors go into the stacked expert weights, HF's separate gate/up into the fused
``gate_up_proj``, FP8 block-quantised weights are paired with their scales and dequantised
(models/quantized_weights.py), and MTP layers (``model.layers.{num_hidden_layers}.*``) are skipped."""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from openinfer.layers.deepseek_moe import DeepseekExperts
from openinfer.models.quantized_weights import Dequantizer
from openinfer.models.weights import WeightLoadError, copy_into

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def checkpoint_tensor_names(model: nn.Module) -> set[str]:
    """Every tensor name an HF checkpoint of this config must contain (per-expert, unfused names)."""
    names: set[str] = set()
    for pname, p in model.named_parameters():
        if pname.endswith(".experts.w13_weight") or pname.endswith(".experts.w2_weight"):
            prefix, kind = pname.rsplit(".", 1)
            projs = ("gate_proj", "up_proj") if kind == "w13_weight" else ("down_proj",)
            names.update(f"{prefix}.{e}.{proj}.weight" for e in range(p.shape[0]) for proj in projs)
        elif ".gate_up_proj." in pname:
            names.update(pname.replace(".gate_up_proj.", f".{p}.") for p in ("gate_proj", "up_proj"))
        else:
            names.add(pname)
    return names


def load_v3_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    args = model.args
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    dequantizer = Dequantizer(args.fp8_block, None, lambda n: n in params)
    mtp = 0
    for raw_name, raw_tensor in weights:
        m = _LAYER.match(raw_name)
        if m and int(m.group(1)) >= args.num_hidden_layers:
            mtp += 1
            continue
        if "rotary_emb.inv_freq" in raw_name or (args.tie_word_embeddings and raw_name == "lm_head.weight"):
            continue
        for name, tensor in dequantizer.feed(raw_name, raw_tensor):
            _load_one(model, params, name, tensor)
            loaded.add(name)
    dequantizer.finish()
    if mtp:
        logger.info("ignoring %d MTP tensors (model.layers.%d.*): MTP speculative decoding is not supported",
                    mtp, args.num_hidden_layers)
    missing = checkpoint_tensor_names(model) - loaded
    if missing:
        raise WeightLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
    return loaded


def _load_one(model: nn.Module, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    m = _EXPERT.match(name)
    if m:
        experts = _submodule(model, m.group(1), name)
        e, proj = int(m.group(2)), m.group(3)
        if not isinstance(experts, DeepseekExperts) or e >= experts.w13_weight.shape[0]:
            raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model")
        i = experts.intermediate_size
        dst = {"gate_proj": experts.w13_weight[e, :i], "up_proj": experts.w13_weight[e, i:],
               "down_proj": experts.w2_weight[e]}[proj]
        copy_into(dst, tensor, name)
        return
    for proj, shard in ((".gate_proj.", 0), (".up_proj.", 1)):
        if proj in name:  # dense MLP / shared experts: HF's gate and up fill halves of gate_up_proj
            fused = params.get(name.replace(proj, ".gate_up_proj."))
            if fused is None:
                raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model")
            half = fused.shape[0] // 2
            copy_into(fused[shard * half:(shard + 1) * half], tensor, name)
            return
    if name not in params:
        raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model")
    copy_into(params[name], tensor, name)


def _submodule(model: nn.Module, path: str, name: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model") from None
