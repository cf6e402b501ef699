"""DeepInfer's V4.1 checkpoint names (``deepinfer/hugging_face/names.py``) -> DeepseekV41ForCausalLM parameters.

The leaf names are V4's release names (``layers.N.attn.wq_a``, ``.attn.compressor.wkv``, ``.hc_attn_fn``,
``.ffn.experts.E.w1`` ...), so V4's ``canonical_name`` maps them; V4.1 adds ``attn.indexer.wk`` / ``k_norm``
(index-K sources only), ``ffn.gate.bias_vl`` and ``engram.{embed.weight, wkv.weight, q_weight, k_weight}``.
Quantisation (config's ``quantization_config``): FP8 e4m3 linears with UE8M0 ``.scale`` per 32x32 block, MXFP4
routed experts, and the Engram tables in FP8 with one UE8M0 scale per 32 values of a row ([rows, dim/32]). The
MXFP4 experts stay packed where their experts module keeps them, and the FP8 linears (32x32 blocks) as shipped
where ``packs_fp8`` accepts the module (V4's rules: a single-rank CPU ``Linear`` only multiplied - not
``o_a_proj``, read as a grouped matrix; ``OPENINFER_FP8_WEIGHTS=dequantize`` opts out); the Engram tables are
dequantised at load.
``mtp.*`` (the DSpark draft blocks) builds ``model.mtp`` on first sight; a checkpoint without them loads, and
drafting is unavailable (said once). ``mtp.N.embed`` / ``mtp.N.head`` copies are skipped, as DeepInfer skips them.
The vision tower (``vision.*``, ``aligner.*``, ``image_start / end / newline``; config ``vision_config``) loads
into ``model.vision`` (vision_names.py); for text-only serving (``--limit-mm-per-prompt '{"image": 0}'``) it is
not built and its tensors are checked against DeepInfer's names and skipped.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch

from openinfer.layers.fp8 import FP8_DTYPE, dequantize_fp8_block
from openinfer.layers.quant_linear import QuantizedWeight
from openinfer.models.deepseek_v41.vision_names import IMAGE_MARKERS, is_vision_tensor, vision_param_name
from openinfer.models.deepseek_v4.loading import (_copy_shard, _expected, _keeps_packed, _load_packed_linear, _targets,
                                                  canonical_name)
from openinfer.models.quantized_weights import Dequantizer
from openinfer.models.weights import WeightLoadError, copy_into

logger = logging.getLogger(__name__)
ENGRAM_TABLE = "engram.embed.weight"
# The DSpark blocks read the backbone's embedding and head; DeepInfer skips per-block copies (names.py hf_to_model
# maps them to nothing: "tied, HF stores only one copy, in the backbone").
TIED_MTP_COPY = re.compile(r"^(model\.)?mtp\.\d+\.(embed|head)\.(weight|scale)$")


def _vision_tensor(model, name: str, tensor: torch.Tensor) -> str | None:
    """A tensor of the vision tower: the parameter it loads into, or "" when the tower is not built (text-only
    serving: --limit-mm-per-prompt '{"image": 0}'), after checking it belongs; None for any other tensor."""
    if not is_vision_tensor(name):
        return None
    if model.config.vision is None:
        raise WeightLoadError(f"checkpoint tensor {name!r} belongs to the vision tower, but config.json has no "
                              "vision_config")
    plain = name.removeprefix("model.")
    if plain in IMAGE_MARKERS and tuple(tensor.shape) != (model.config.hidden_size,):
        raise WeightLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                              f"({model.config.hidden_size},): one embedding of the text width")
    return "" if model.vision is None else vision_param_name(name)


class _V41Dequantizer(Dequantizer):
    def _dequantize(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if name.endswith(ENGRAM_TABLE) and weight.dtype == FP8_DTYPE:
            try:  # a scale per 32 values of each row
                return dequantize_fp8_block(weight, scale, (1, 32), torch.float32)
            except ValueError as e:
                raise WeightLoadError(f"tensor {name!r}: {e}") from None
        return super()._dequantize(name, weight, scale)


def load_v41_weights(model, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    targets = _targets(model)
    loaded: set[str] = set()
    # targets is rebound when the DSpark blocks are built; the lambda reads the current binding.
    dequantizer = _V41Dequantizer(model.config.fp8_block, model.config.expert_dtype,
                                  lambda n: canonical_name(n)[0] in targets,
                                  keep_packed=lambda n: _keeps_packed(model, n))
    vision_skipped = 0
    for raw_name, raw_tensor in weights:
        if TIED_MTP_COPY.match(raw_name):
            continue
        vision_param = _vision_tensor(model, raw_name, raw_tensor)
        if vision_param == "":
            vision_skipped += 1
            continue
        if vision_param is not None:
            if vision_param not in targets:
                raise WeightLoadError(f"checkpoint tensor {raw_name!r} does not belong to the vision tower "
                                      f"(mapped to {vision_param!r}; see vision_config in config.json)")
            copy_into(targets[vision_param], raw_tensor, raw_name)
            loaded.add(vision_param)
            continue
        for name, tensor in dequantizer.feed(raw_name, raw_tensor):
            pname, shard = canonical_name(name)
            if pname.startswith("mtp.") and model.mtp is None:
                if int(pname.split(".")[1]) >= model.config.num_nextn_predict_layers:
                    raise WeightLoadError(f"checkpoint tensor {name!r}: config has only num_nextn_predict_layers="
                                          f"{model.config.num_nextn_predict_layers} DSpark blocks")
                model.build_mtp()
                targets = _targets(model)
            if model.config.tie_word_embeddings and pname == "lm_head.weight":
                continue
            if pname not in targets:
                raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model "
                                      f"(mapped to {pname!r}; see kv_source_layer_ids / index_source_layer_ids "
                                      f"/ engram_layer_ids in config.json)")
            param = targets[pname]
            if shard is None and isinstance(tensor, QuantizedWeight):  # an FP8 linear kept as shipped
                _load_packed_linear(model, pname, tensor, name, None)
                loaded.add(pname)
            elif shard is None:
                copy_into(param, tensor, name)
                loaded.add(pname)
            else:
                _copy_shard(model, pname, param, tensor, name, shard)
                loaded.add(f"{pname}#{shard}")
    dequantizer.finish()
    missing = sorted(_expected(model, targets) - loaded)
    if missing:
        raise WeightLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
    if vision_skipped:
        logger.info("DeepSeek-V4.1 vision tower not built (text-only serving, --limit-mm-per-prompt "
                    "'{\"image\": 0}'): %d vision tensors skipped", vision_skipped)
    if model.mtp is None and model.config.num_nextn_predict_layers:
        logger.info("checkpoint has no DSpark weights (mtp.*): the model runs, drafting is unavailable")
    return loaded
