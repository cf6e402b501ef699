"""A checkpoint's low-bit format and the ``--quantization`` flag: config.json's ``quantization_config`` read into
one typed record (the formats people publish), checked against what this engine runs exactly, and the flag checked
against it. Pure Python: the engine config and the loader both read it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Quantised at load (layers/quant_linear.py says how each is laid out): int8 / int4 weight-only, w8a8 = int8 weights
# per output channel and int8 activations per token, quantised dynamically; w4a8 = int4 weights (per group) with
# those int8 activations.
QUANTIZATION_METHODS = ("int8", "int4", "w8a8", "w4a8")


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a low-bit checkpoint holds, read from config.json's ``quantization_config`` (the formats people publish):

    - ``compressed-tensors`` (llm-compressor) ``int-quantized`` / ``naive-quantized``: W8A8 int8, ``X.weight`` int8
      [N, K] + ``X.weight_scale`` [N, 1] per channel, activations per token, dynamic, symmetric -> method ``w8a8``.
    - ``compressed-tensors`` ``pack-quantized``: W4A16, ``X.weight_packed`` int32 [N, K / 8] (8 nibbles along K,
      value + 8), ``X.weight_scale`` [N, K / group], ``X.weight_shape`` [2], symmetric -> method ``int4``.
    - ``gptq`` 4-bit, no desc_act, sym or not: ``X.qweight`` int32 [K / 8, N] (8 nibbles along K), ``X.qzeros``
      int32 [K / group, N / 8] (zero - 1), ``X.scales`` [K / group, N], ``X.g_idx`` [K] -> method ``int4``.
    - ``awq`` 4-bit, zero_point, version ``gemm`` (AutoAWQ's GEMM layout, what vLLM's ``awq`` / ``awq_marlin``
      read): ``X.qweight`` int32 [K, N / 8] (8 nibbles along N, AWQ's interleaved order), ``X.qzeros`` int32
      [K / group, N / 8] (same order), ``X.scales`` fp16 [K / group, N] -> method ``int4``.
    The weights stay in their low-bit form (layers/checkpoint_quant.py repacks them once into the kernels' layout;
    asymmetric zeros become a per-group correction, ``QuantizedWeight.zero_corr``)."""

    quant_method: str  # "compressed-tensors" | "gptq" | "awq"
    format: str  # "int-quantized" | "naive-quantized" | "pack-quantized" | "gptq" | "gemm"
    method: str  # what runs: "w8a8" | "int4" (QUANTIZATION_METHODS)
    group: int = 0  # int4: input columns per scale
    symmetric: bool = True  # False: per-group zero points in the tensors (AWQ, GPTQ sym=false)
    # compressed-tensors' ``ignore`` list (modules left dense, e.g. lm_head) needs no reading: such a module's
    # tensors are plain ``X.weight`` floats, which the loader passes through as they are.


_CT_FORMATS = {"int-quantized": "w8a8", "naive-quantized": "w8a8", "pack-quantized": "int4"}


def _require(cond: bool, field: str, value: Any, want: str) -> None:
    if not cond:
        raise ValueError(f"quantization_config.{field}={value!r} is not supported; {want}")


def checkpoint_quantization(hf_config: dict[str, Any]) -> CheckpointQuantization | None:
    """The checkpoint's low-bit format, None for a plain checkpoint or one the model loads itself (DeepSeek's fp8 /
    MXFP4: ``models/quantized_weights.py``). Anything this engine cannot run exactly is a ValueError naming the
    field (never a silent dequantise)."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {type(qc).__name__}")
    qm = qc.get("quant_method")
    if qm == "compressed-tensors":
        return _compressed_tensors(qc)
    if qm == "gptq":
        return _gptq(qc)
    if qm == "awq":
        return _awq(qc)
    return None


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuantization:
    fmt = qc.get("format")
    _require(fmt in _CT_FORMATS, "format", fmt, f"supported: {', '.join(_CT_FORMATS)}")
    _require(qc.get("quantization_status", "compressed") == "compressed", "quantization_status",
             qc.get("quantization_status"), "only 'compressed' checkpoints are loaded")
    groups = qc.get("config_groups") or {}
    _require(isinstance(groups, dict) and len(groups) == 1, "config_groups", list(groups) if isinstance(groups, dict)
             else groups, "exactly one scheme (targets ['Linear']) is supported")
    name, scheme = next(iter(groups.items()))
    _require(scheme.get("targets") == ["Linear"], f"config_groups.{name}.targets", scheme.get("targets"),
             "only ['Linear'] is supported")
    w = scheme.get("weights") or {}
    a = scheme.get("input_activations")
    pre = f"config_groups.{name}"
    _require(w.get("type", "int") == "int", f"{pre}.weights.type", w.get("type"), "only 'int' is supported")
    _require(w.get("symmetric") is True, f"{pre}.weights.symmetric", w.get("symmetric"),
             "only symmetric weights are supported")
    _require(not w.get("dynamic"), f"{pre}.weights.dynamic", w.get("dynamic"), "weights must be static")
    _require(w.get("actorder") in (None, False), f"{pre}.weights.actorder", w.get("actorder"),
             "activation reordering is not supported")
    group = 0
    if _CT_FORMATS[fmt] == "w8a8":
        _require(w.get("num_bits") == 8, f"{pre}.weights.num_bits", w.get("num_bits"), f"{fmt} needs 8")
        _require(w.get("strategy") == "channel", f"{pre}.weights.strategy", w.get("strategy"),
                 "W8A8 int8 needs 'channel'")
        _require(isinstance(a, dict), f"{pre}.input_activations", a, "W8A8 needs int8 input activations")
        _require(a.get("num_bits") == 8 and a.get("type", "int") == "int", f"{pre}.input_activations.num_bits",
                 a.get("num_bits"), "only int8 activations are supported")
        for key, want in (("strategy", "token"), ("dynamic", True), ("symmetric", True)):
            _require(a.get(key) == want, f"{pre}.input_activations.{key}", a.get(key),
                     "only dynamic symmetric per-token activations are supported")
    else:
        _require(w.get("num_bits") == 4, f"{pre}.weights.num_bits", w.get("num_bits"), f"{fmt} needs 4")
        _require(w.get("strategy") == "group", f"{pre}.weights.strategy", w.get("strategy"),
                 "W4A16 needs 'group'")
        group = w.get("group_size")
        _require(isinstance(group, int) and group > 0 and group % 16 == 0, f"{pre}.weights.group_size", group,
                 "a positive multiple of 16 is supported")
        _require(a is None, f"{pre}.input_activations", a, "pack-quantized runs with unquantised activations")
    return CheckpointQuantization("compressed-tensors", fmt, _CT_FORMATS[fmt], group)


def _gptq(qc: dict[str, Any]) -> CheckpointQuantization:
    _require(qc.get("bits") == 4, "bits", qc.get("bits"), "only 4-bit GPTQ is supported")
    _require(isinstance(qc.get("sym", True), bool), "sym", qc.get("sym"), "true or false")
    _require(not qc.get("desc_act"), "desc_act", qc.get("desc_act"),
             "activation-order (desc_act) GPTQ checkpoints are not supported")
    _require(not qc.get("lm_head"), "lm_head", qc.get("lm_head"), "a quantised lm_head is not supported")
    _require(qc.get("checkpoint_format", "gptq") == "gptq", "checkpoint_format", qc.get("checkpoint_format"),
             "only 'gptq' (v1, zeros stored minus one) is supported")
    group = qc.get("group_size")
    _require(isinstance(group, int) and group > 0 and group % 16 == 0, "group_size", group,
             "a positive multiple of 16 is supported (-1, one group per row, is not)")
    return CheckpointQuantization("gptq", "gptq", "int4", group, symmetric=qc.get("sym", True))


# AutoAWQ's other kernels' layouts: "gemv" / "gemv_fast" pack along K in another order, "marlin" / "exllama" are
# repacked for those GPU kernels. Only "gemm" (the published default, what vLLM's awq / awq_marlin load) is read.
_AWQ_VERSIONS = ("gemm",)


def _awq(qc: dict[str, Any]) -> CheckpointQuantization:
    """AutoAWQ's config (``w_bit`` / ``q_group_size`` are the names of its older ``quant_config.json``, which
    vLLM's awq config also accepts). ``modules_to_not_convert`` needs no reading: those modules' tensors are plain
    ``X.weight`` floats, which the loader passes through as they are."""
    bits = qc.get("bits", qc.get("w_bit"))
    _require(bits == 4, "bits", bits, "only 4-bit AWQ is supported")
    version = str(qc.get("version", "gemm")).lower()
    _require(version in _AWQ_VERSIONS, "version", qc.get("version"),
             "only 'gemm' (AutoAWQ's GEMM layout) is supported")
    _require(qc.get("zero_point", True) is True, "zero_point", qc.get("zero_point"),
             "only zero-point (asymmetric) AWQ is supported")
    group = qc.get("group_size", qc.get("q_group_size"))
    _require(isinstance(group, int) and group > 0 and group % 16 == 0, "group_size", group,
             "a positive multiple of 16 is supported (-1, one group per row, is not)")
    skip = qc.get("modules_to_not_convert")
    _require(skip is None or (isinstance(skip, list) and all(isinstance(m, str) for m in skip)),
             "modules_to_not_convert", skip, "a list of module names or null")
    return CheckpointQuantization("awq", "gemm", "int4", group, symmetric=False)


def check_quantization(method: str | None, hf_config: dict[str, Any]) -> str | None:
    """``--quantization``: a known method to quantise plain weights with at load. On a low-bit checkpoint the
    weights are already quantised: the flag may only repeat the checkpoint's method, and nothing is quantised
    again (None). Whether the model class runs quantised linears is checked by engine_args (it may import models)."""
    ckpt = checkpoint_quantization(hf_config)
    if method is None or method in ("", "none"):
        return None
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={method!r} is not supported; choose one of "
                         f"{', '.join(QUANTIZATION_METHODS)}")
    if ckpt is not None:
        if method != ckpt.method:
            raise ValueError(f"quantization={method!r} does not match the checkpoint, which is {ckpt.method} "
                             f"({ckpt.quant_method} {ckpt.format}); omit the flag or pass {ckpt.method!r}")
        return None
    if hf_config.get("quantization_config"):
        raise ValueError(f"quantization={method!r}: the checkpoint is already quantised "
                         f"(config.json quantization_config); quantising it again is not supported")
    return method
