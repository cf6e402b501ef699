"""Checkpoint names -> DeepseekV4ForCausalLM parameters, for both naming styles (spec §3, §12).

- transformers' ``save_pretrained``: DeepSeek's original leaf names under ``model.`` (``model.layers.N.attn.wq_a``,
  ``model.embed_tokens.weight``, ``model.hc_head.hc_fn``, ``head.weight``), no MTP tensors.
- DeepSeek's release: unprefixed (``embed.weight``, ``layers.N...``, ``hc_head_fn``, ``head.weight``, ``mtp.K...``).
Per-expert ``w1``/``w3``/``w2`` go into the stacked ``w13_weight`` / ``w2_weight``; the shared expert's
``w1``/``w3`` into its fused ``gate_up_proj``. FP8 weights stay as shipped where their module takes them (linears
``packs_fp8`` accepts, experts modules built with ``fp8_block``), else they are dequantised on the way
(models/quantized_weights.py); MXFP4 routed experts too, unless their experts module keeps them packed
(``DeepseekExperts.mxfp4``).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch

from openinfer.layers.deepseek_moe import DeepseekExperts
from openinfer.layers.quant_linear import QuantizedWeight
from openinfer.models.quantized_weights import Dequantizer, packs_fp8, scale_owner
from openinfer.models.weights import WeightLoadError, copy_into, materialize

logger = logging.getLogger(__name__)

_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight", "embed_tokens.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight", "lm_head.weight": "lm_head.weight", "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale", "hc_head.hc_fn": "model.hc_head.hc_fn",
    "hc_head.hc_base": "model.hc_head.hc_base", "hc_head.hc_scale": "model.hc_head.hc_scale",
}

# Applied in order to ".<rest>" of a layer's tensor name (the part after "layers.N" / "mtp.K").
_LAYER_RENAMES = [
    (r"^\.attn_norm\.", ".input_layernorm."),
    (r"^\.ffn_norm\.", ".post_attention_layernorm."),
    (r"^\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"^\.hc_head_(fn|base|scale)$", r".hc_head.hc_\1"),
    (r"^\.attn\.", ".self_attn."),
    (r"^\.ffn\.", ".mlp."),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.ape$", ".position_bias"),
    (r"^(\.self_attn(\.indexer)?(\.compressor)?)\.norm\.", r"\1.kv_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
]
_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.w([123])\.weight$")
_SHARED = re.compile(r"^(.*\.mlp\.shared_experts)\.w([123])\.weight$")
_LAYER = re.compile(r"^(layers|mtp)\.(\d+)(\..+)$")


def canonical_name(name: str) -> tuple[str, tuple[int | None, int] | None]:
    """Checkpoint name -> (parameter name, shard). shard = (expert or None, part): part 0/1 = gate/up rows of a
    fused gate_up tensor, 2 = a routed expert's w2 slice."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name], None
    m = _LAYER.match(name)
    if m is None:
        return name, None
    kind, idx, rest = m.groups()
    for pattern, repl in _LAYER_RENAMES:
        rest = re.sub(pattern, repl, rest)
    full = (f"model.layers.{idx}" if kind == "layers" else f"mtp.{idx}") + rest
    if (e := _EXPERT.match(full)) is not None:
        part = {"1": 0, "3": 1, "2": 2}[e.group(3)]
        proj = "w2_weight" if part == 2 else "w13_weight"
        return f"{e.group(1)}.experts.{proj}", (int(e.group(2)), part)
    if (s := _SHARED.match(full)) is not None:
        if s.group(2) == "2":
            return f"{s.group(1)}.down_proj.weight", None
        return f"{s.group(1)}.gate_up_proj.weight", (None, 0 if s.group(2) == "1" else 1)
    return full, None


def _targets(model) -> dict[str, torch.Tensor]:
    targets = dict(model.named_parameters())
    targets.update({n: b for n, b in model.named_buffers() if n.endswith("tid2eid")})
    return targets


def _copy_shard(model, pname: str, param: torch.Tensor, tensor, name: str, shard: tuple[int | None, int]) -> None:
    """A routed expert's w1/w3/w2 (the experts module places it: its slice under tensor parallelism), or part of
    the shared expert's fused gate_up (its weight_loader)."""
    expert, part = shard
    if expert is None and isinstance(tensor, QuantizedWeight):  # FP8 kept as shipped (packs_fp8)
        _load_packed_linear(model, pname, tensor, name, part)
        return
    if expert is None:
        param.weight_loader(param, tensor, part)
        return
    experts = model.get_submodule(pname.rsplit(".", 1)[0])
    if not 0 <= expert < experts.num_experts:
        raise WeightLoadError(f"checkpoint tensor {name!r}: expert {expert} is out of range")
    experts.load_expert(expert, part, tensor)


def _not_this_ranks_expert(model, raw_name: str) -> bool:
    pname, shard = canonical_name(scale_owner(raw_name) or raw_name)
    if shard is None or shard[0] is None or not pname.endswith(("experts.w13_weight", "experts.w2_weight")):
        return False
    try:
        experts = model.get_submodule(pname.rsplit(".", 1)[0])
    except AttributeError:
        return False  # not this model's: the loader names it
    return 0 <= shard[0] < experts.num_experts and shard[0] not in experts.expert_ids


def _load_packed_linear(model, pname: str, tensor: QuantizedWeight, name: str, part: int | None) -> None:
    try:
        model.get_submodule(pname.rsplit(".", 1)[0]).load_quantized(tensor, part)
    except ValueError as e:
        raise WeightLoadError(f"checkpoint tensor {name!r}: {e}") from None


def _packs(experts) -> bool:
    return bool(experts.mxfp4 or experts.fp8_block is not None)


def _keeps_packed(model, name: str, linears: bool = True) -> bool:
    """A routed expert's weight whose experts module keeps MXFP4 / FP8 packed (an MTP block's too: built with the
    same setting when its first tensor arrives, so the model's setting is asked when its module does not exist
    yet), or (``linears``) an FP8 linear ``packs_fp8`` accepts."""
    pname, shard = canonical_name(name)
    try:
        module = model.get_submodule(pname.rsplit(".", 1)[0])
    except AttributeError:
        module = None
    if shard is None or shard[0] is None:
        return linears and packs_fp8(module, model.config.fp8_block)
    if module is None:
        return any(_packs(m) for m in model.modules() if isinstance(m, DeepseekExperts))
    return _packs(module)


def load_v4_weights(model, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    targets = _targets(model)
    loaded: set[str] = set()
    # targets is rebound when the MTP block is built; the lambda reads the current binding.
    dequantizer = Dequantizer(model.config.fp8_block, model.config.expert_dtype,
                              lambda n: canonical_name(n)[0] in targets,
                              keep_packed=lambda n: _keeps_packed(model, n))
    for raw_name, raw_tensor in weights:
        if _not_this_ranks_expert(model, raw_name):
            continue  # expert parallelism: another rank holds it (and reads it)
        for name, tensor in dequantizer.feed(raw_name, raw_tensor):
            pname, shard = canonical_name(name)
            if pname.startswith("mtp.") and model.mtp is None:
                if int(pname.split(".")[1]) >= model.config.num_nextn_predict_layers:
                    raise WeightLoadError(f"checkpoint tensor {name!r}: config has only "
                                          f"{model.config.num_nextn_predict_layers} MTP layers")
                model.build_mtp()
                targets = _targets(model)
            if model.config.tie_word_embeddings and pname == "lm_head.weight":
                continue
            if pname not in targets:
                raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model "
                                      f"(mapped to {pname!r})")
            if pname.endswith("tid2eid"):
                tensor = materialize(tensor)
                _check_hash_table(name, tensor, model.config.n_routed_experts)
            param = targets[pname]
            if shard is None and isinstance(tensor, QuantizedWeight):
                _load_packed_linear(model, pname, tensor, name, None)
                loaded.add(pname)
            elif shard is None:
                loader = getattr(param, "weight_loader", None)
                loader(param, tensor) if loader is not None else copy_into(param, tensor, name)
                loaded.add(pname)
            else:
                _copy_shard(model, pname, param, tensor, name, shard)
                loaded.add(f"{pname}#{shard}")
    dequantizer.finish()
    expected = _expected(model, targets)
    missing = sorted(expected - loaded)
    if missing:
        raise WeightLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
    if model.mtp is None and model.config.num_nextn_predict_layers:
        logger.info("checkpoint has no MTP weights (mtp.*): the model runs, speculative decoding is unavailable")
    return loaded


def _check_hash_table(name: str, table: torch.Tensor, num_experts: int) -> None:
    # An out-of-range id would index past the stacked experts at the first forward, far from the cause.
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= num_experts):
        raise WeightLoadError(f"checkpoint tensor {name!r} holds expert ids in [{int(table.min())}, "
                              f"{int(table.max())}], outside [0, n_routed_experts={num_experts})")


def _expected(model, targets: dict[str, torch.Tensor]) -> set[str]:
    expected: set[str] = set()
    for pname, t in targets.items():
        if model.config.tie_word_embeddings and pname == "lm_head.weight":
            continue
        if pname.endswith("experts.w13_weight"):
            ids = model.get_submodule(pname.rsplit(".", 1)[0]).expert_ids
            expected.update(f"{pname}#{(e, p)}" for e in ids for p in (0, 1))
        elif pname.endswith("experts.w2_weight"):
            ids = model.get_submodule(pname.rsplit(".", 1)[0]).expert_ids
            expected.update(f"{pname}#{(e, 2)}" for e in ids)
        elif pname.endswith("shared_experts.gate_up_proj.weight"):
            expected.update(f"{pname}#{(None, p)}" for p in (0, 1))
        else:
            expected.add(pname)
    return expected
