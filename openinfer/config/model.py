"""What the checkpoint is and how its ops run: the dtype, the attention and kernel backends, the model."""
from __future__ import annotations

import dataclasses
import enum
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openinfer.gguf_file import find_gguf, gguf_config
from openinfer.platform import cpu_has_fast_bf16, resolve_device
from openinfer.quantization_config import CheckpointQuantization, check_quantization, checkpoint_quantization

if TYPE_CHECKING:  # torch is imported lazily so the scheduler's configs load without it
    import torch


_DTYPE_NAMES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


def resolve_dtype(dtype: str | torch.dtype, hf_config: dict[str, Any], device: torch.device) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # bf16 is the fast path on GPUs and on CPUs with bf16 matrix units (AMX / AVX512-BF16). On other
        # CPUs (e.g. AVX2-only EPYC) oneDNN emulates bf16 and matmuls run ~3x slower than fp32, so auto
        # picks fp32 there; an explicit dtype is always honoured.
        if device.type == "cpu" and not cpu_has_fast_bf16():
            return torch.float32
        return torch.bfloat16
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of auto, {', '.join(sorted(_DTYPE_NAMES))}")
    return getattr(torch, _DTYPE_NAMES[dtype])


class AttentionBackend(enum.Enum):
    """Chosen once, when the model is built: ``SDPA`` is the fast path (fused kernels where they apply),
    ``REFERENCE`` plain torch attention that is slow and obviously right (tests, debugging)."""

    SDPA = "sdpa"
    REFERENCE = "reference"

    @classmethod
    def parse(cls, value: str | AttentionBackend) -> AttentionBackend:
        if isinstance(value, cls):
            return value
        if value == "auto":
            return cls.SDPA
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"attention_backend={value!r}; choose one of auto, sdpa, reference") from None


KERNEL_BACKENDS = ("auto", "cpu", "torch")


@dataclass(frozen=True)
class KernelConfig:
    """How ops run: the C++ CPU kernels or torch's own ops (``--kernel-backend``), and the switches that turn single
    kernel families off (to measure against them or bisect). ``layers/dispatch.py`` turns it, with the platform,
    into the implementation of every op kind once at load; nothing below reads the environment.

    ``backend``: ``auto`` builds the CPU kernels where the device is the CPU and a C++ toolchain is present (a
    failed build stops start-up with the compiler's error), else uses torch; ``cpu`` requires them; ``torch``
    never builds them."""

    backend: str = "auto"
    panels: bool = True  # 16-column weight panels (fp32; bf16 without native bf16)
    gemv: bool = True  # the small-M gemv kernel on plain weights
    prepack: bool = True  # prepack linear weights at load (panels or oneDNN's blocked layout)
    decode_blocks: bool = True  # fused C++ decode-step blocks
    amx: bool = True  # AMX tiles in the decode attention kernels where the CPU has them
    bf16_dot: bool = True  # AVX512-BF16 dot products in the bf16 routed-expert kernel where the build has them
    fp8_weights: str = "packed"  # packed | dequantize (FP8 block-quantised linears)
    mxfp4_experts: str = "packed"  # packed | dequantize (MXFP4 routed experts)
    # auto | int8 | fp32: GGUF linears' activations (int8 per 32 columns + integer dots, or fp32; auto: int8 where
    # the kernel build has a SIMD integer dot product, layers/dispatch.py)
    gguf_activations: str = "auto"
    cflags: str = ""  # appended to the kernel build's compiler flags
    cache_dir: str | None = None  # the kernel build's cache folder (None: torch's extension cache)

    def __post_init__(self) -> None:
        if self.backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend={self.backend!r}; choose one of {', '.join(KERNEL_BACKENDS)}")
        for name in ("fp8_weights", "mxfp4_experts"):
            if getattr(self, name) not in ("packed", "dequantize"):
                raise ValueError(f"kernel {name}={getattr(self, name)!r}; choose packed or dequantize")
        if self.gguf_activations not in ("auto", "int8", "fp32"):
            raise ValueError(f"kernel gguf_activations={self.gguf_activations!r}; choose auto, int8 or fp32")

    @classmethod
    def from_env(cls, backend: str = "auto") -> KernelConfig:
        """The one place the ``OPENINFER_*`` kernel switches become config (envs.py lists them).
        ``OPENINFER_CPU_KERNELS=0`` means ``torch`` unless a backend other than auto was asked for."""
        from openinfer import envs

        if backend == "auto" and not envs.CPU_KERNELS:
            backend = "torch"
        return cls(backend=backend, panels=envs.CPU_PANELS, gemv=envs.CPU_GEMV, prepack=envs.CPU_PREPACK,
                   decode_blocks=envs.DECODE_BLOCKS, amx=envs.CPU_AMX, bf16_dot=envs.CPU_BF16_DOT,
                   fp8_weights=envs.FP8_WEIGHTS,
                   mxfp4_experts=envs.MXFP4_EXPERTS, gguf_activations=envs.GGUF_ACTIVATIONS, cflags=envs.KERNEL_CFLAGS or "",
                   cache_dir=envs.KERNEL_CACHE or None)


@dataclass(frozen=True)
class ModelConfig:
    """What the checkpoint is: the path, its raw config.json, and the dtype/device it runs in."""

    path: str
    hf_config: dict[str, Any]
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    tokenizer_path: str
    # --quantization: the linear weights kept low-bit, quantised at load (layers/quant_linear.py); None = as loaded
    quantization: str | None = None
    # --limit-mm-per-prompt (vLLM's): most items of each modality one prompt may carry; None = no limit. An image
    # limit of 0 on a model with a vision tower serves text only, without building the tower (hf_config then
    # carries ``_text_only``).
    limit_mm_per_prompt: dict[str, int] | None = None
    # --allowed-local-media-path (vLLM's): the folder requests may name image files in (file:// URLs); None = none.
    allowed_local_media_path: str | None = None

    def with_mm_limits(self, text: str | dict | None) -> ModelConfig:
        """``--limit-mm-per-prompt`` applied: JSON (or a dict) of modality -> count, e.g. ``{"image": 0}``."""
        if text is None:
            return self
        try:
            limits = json.loads(text) if isinstance(text, str) else text
        except json.JSONDecodeError as e:
            raise ValueError(f"limit_mm_per_prompt is not valid JSON: {e}") from None
        if not isinstance(limits, dict) or any(
                not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in limits.values()):
            raise ValueError(f"limit_mm_per_prompt must map modalities to counts >= 0, e.g. '{{\"image\": 0}}', "
                             f"got {text!r}")
        other = sorted(k for k, v in limits.items() if k != "image" and v)
        if other:  # a zero limit on another modality is what openinfer does anyway
            raise ValueError(f"limit_mm_per_prompt: openinfer takes images only; {other} must be 0")
        hf = dict(self.hf_config)
        if limits.get("image") == 0:
            hf["_text_only"] = True
        return dataclasses.replace(self, hf_config=hf, limit_mm_per_prompt=dict(limits))

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or []
        return archs[0] if archs else ""

    @property
    def checkpoint_quantization(self) -> CheckpointQuantization | None:
        """The low-bit format the checkpoint ships in (compressed-tensors, GPTQ), None for plain weights."""
        return checkpoint_quantization(self.hf_config)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @classmethod
    def from_path(
        cls,
        path: str | os.PathLike,
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        max_model_len: int | None = None,
        tokenizer: str | None = None,
        quantization: str | None = None,
    ) -> ModelConfig:
        p = Path(path)
        gguf = find_gguf(p)
        if gguf is not None:  # llama.cpp's single-file format: config from its metadata (gguf_file.py)
            return cls._from_gguf(gguf, dtype, device, max_model_len, tokenizer, quantization)
        if not p.is_dir():
            raise ValueError(f"model path {str(path)!r} does not exist or is not a directory (nor a .gguf file)")
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"model path {str(path)!r} has no config.json (nor a .gguf file)")
        try:
            hf_config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
        if "text_config" in hf_config and "vocab_size" not in hf_config:
            # Multimodal wrappers nest the language model's fields.
            # Wrapper-level fields the language model needs (DeepSeek-V4.1's quantization_config, dtype, token
            # ids) stay visible; text_config's own fields win.
            outer = {k: v for k, v in hf_config.items() if k != "text_config"}
            hf_config = {**outer, **hf_config["text_config"], "architectures": hf_config.get("architectures")}
        # Where the checkpoint lives, for models that read more than config.json (DeepSeek-V4.1's Engram builds
        # its compressed vocabulary from tokenizer.json).
        hf_config = {**hf_config, "_checkpoint_dir": str(p)}
        return cls._build(p, hf_config, dtype, device, max_model_len, tokenizer, quantization)

    @classmethod
    def _from_gguf(cls, file: Path, dtype, device, max_model_len, tokenizer, quantization) -> ModelConfig:
        hf_config = gguf_config(file)
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} does not apply to a GGUF file: its weights run in the "
                             "file's own quantized types")
        if dtype == "auto" and resolve_device(device).type == "cpu":
            dtype = "float32"  # as llama.cpp runs GGUF activations; the packed kernels take fp32 inputs either way
        return cls._build(file, hf_config, dtype, device, max_model_len, tokenizer, None)

    @classmethod
    def _build(cls, p: Path, hf_config: dict[str, Any], dtype, device, max_model_len, tokenizer,
               quantization) -> ModelConfig:
        dev = resolve_device(device)
        limit = int(hf_config.get("max_position_embeddings", 2048))
        if max_model_len is None:
            max_model_len = limit
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {max_model_len}")
        if max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}"
            )
        return cls(
            path=str(p),
            hf_config=hf_config,
            dtype=resolve_dtype(dtype, hf_config, dev),
            device=dev,
            max_model_len=int(max_model_len),
            tokenizer_path=str(tokenizer or p),
            quantization=check_quantization(quantization, hf_config),
        )

    @property
    def gguf_file(self) -> str | None:
        """The GGUF file the weights come from (None: an HF-format folder)."""
        return self.hf_config.get("_gguf_file")
