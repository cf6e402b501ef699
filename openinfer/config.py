"""One typed configuration, built once by the entrypoint and passed down.

Users set engine settings through ``EngineArgs`` (engine_args.py, the one list); its ``create_engine_config``
builds these frozen dataclasses, which validate in ``__post_init__`` so that a bad value fails at construction
with a message naming the field, never deep inside a step.
"""
from __future__ import annotations

import dataclasses

import enum
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openinfer.platform import cpu_has_fast_bf16, resolve_device
from openinfer.gguf_file import find_gguf, gguf_config
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


# fp8_e5m2 (vLLM's other fp8) is not offered: e4m3's extra mantissa bit is what a scale-1.0 cache wants.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla", "fp4", "mxfp8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Memory for the KV cache; None = derive from memory free after warm-up (see worker.Worker.determine_kv_budget).
    kv_cache_memory_gb: float | None = None
    # Fraction of free device memory used when kv_cache_memory_gb is unset.
    memory_utilization: float = 0.9
    # vLLM's --gpu-memory-utilization: the share of the device's whole memory this instance may use (weights,
    # activations and KV cache together); the KV cache gets what is left of it after warm-up. Overrides
    # memory_utilization when set (worker.kv_budget_for_utilization).
    gpu_memory_utilization: float | None = None
    # Exact block count (tests use it to force preemption); overrides the memory-based size.
    num_kv_blocks: int | None = None
    # What the cache stores (vLLM's names): "auto" = the model's dtype; "fp8" / "fp8_e4m3" = float8_e4m3fn with
    # scale 1.0 (layers/kv_quant.py); "fp8_ds_mla" = DeepSeek-V4's packed fp8 entry layout (what "fp8" selects
    # on V4 anyway); "fp4" / "mxfp8" = DeepSeek-V4.1's compressed KV in DeepInfer's FP4 / MXFP8 (on V4.1 "fp8" is
    # DeepInfer's choice from the config's use_fp4_sparse_kv; models/deepseek_v41/cache.py).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype != "auto"


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """The step's shape. ``max_model_len`` is not here: its one home is ``ModelConfig`` (each ``Request``
    receives it once and caps its ``max_tokens`` with it)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # KV slots allocated past each scheduled request's tokens: a drafting model writes its chain of drafts there.
    num_lookahead_tokens: int = 0
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority" (lower ``priority`` value first, ties by
    # arrival; preemption takes the lowest priority running request first).
    policy: str = "fcfs"
    # speculative_config.confidence_token_cost: the confidence head decides how many drafts are verified
    confidence_token_cost: float | None = None

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.policy!r}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")


EXECUTOR_BACKENDS = ("auto", "uni", "mp", "ray", "external_launcher")


@dataclass(frozen=True)
class ParallelConfig:
    """How one deployment is spread over processes: ``data_parallel_size`` attention replicas (each with its own
    scheduler, KV cache and requests), each split over ``tensor_parallel_size`` ranks. Ranks are numbered
    ``dp_rank * tensor_parallel_size + tp_rank``. The executor backend runs them: ``uni`` in the engine's own
    process (one rank only), ``mp`` one worker process per rank, ``ray`` one Ray actor per rank (a Ray cluster
    spanning machines runs one deployment), ``external_launcher`` one engine per rank started
    by torchrun (or any launcher that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT: the multi-node path
    without Ray); ``auto`` picks ``uni`` for one rank, ``mp`` otherwise."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # Routed experts split over every rank (instead of each expert's intermediate split over the TP ranks): the
    # expert-parallel size is tensor_parallel_size x data_parallel_size, as vLLM's; attention stays TP-sharded.
    enable_expert_parallel: bool = False
    # Expert load balancing: count tokens per expert, and every eplb_step_interval steps re-place the experts
    # (plus num_redundant_experts replicas of the busiest) over the ranks.
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_step_interval: int = 1000
    distributed_executor_backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r}; choose one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}")
        if (self.enable_eplb or self.num_redundant_experts) and not self.enable_expert_parallel:
            raise ValueError("enable_eplb / num_redundant_experts place experts over expert-parallel ranks: set "
                             "enable_expert_parallel")
        if not isinstance(self.num_redundant_experts, int) or self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be an integer >= 0, got {self.num_redundant_experts!r}")
        if not isinstance(self.eplb_step_interval, int) or self.eplb_step_interval < 1:
            raise ValueError(f"eplb_step_interval must be an integer >= 1, got {self.eplb_step_interval!r}")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank in the engine's process, but "
                             f"tensor_parallel_size={self.tensor_parallel_size} x data_parallel_size="
                             f"{self.data_parallel_size} needs {self.world_size}; use 'mp'")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def lockstep(self) -> bool:
        """Replicas meet in collectives inside the model (expert-parallel MoE): an idle replica's ranks must
        still run a forward whenever another replica steps."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend != "auto":
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"


SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): each step a proposer drafts ``num_speculative_tokens``
    tokens per decoding request and the target verifies them all in one forward.

    - ``ngram`` (prompt lookup): the longest n in [prompt_lookup_min, prompt_lookup_max] whose last n tokens occur
      earlier in the prompt + output proposes what followed them. No weights.
    - ``draft_model``: a smaller model with the same vocabulary (``model``), its own KV cache.
    - ``mtp``: the target's own multi-token-prediction layers (DeepSeek-V3 / V4; on DeepSeek-V4.1 its DSpark draft
      blocks, which draft all k in one block forward, k <= dspark_block_size)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: str | None = None
    # Confidence-scheduled verification (engine/confidence_schedule.py, DeepInfer's MTP varlen): None verifies
    # every draft; a cost >= 0 lets the DSpark confidence head pick how many drafts each request verifies.
    confidence_token_cost: float | None = None

    def __post_init__(self) -> None:
        c = self.confidence_token_cost
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < float("inf")):
            raise ValueError(f"speculative_config.confidence_token_cost must be a finite number >= 0, got {c!r}")
        if c is not None and self.method != "mtp":
            raise ValueError("speculative_config.confidence_token_cost needs the DSpark confidence head: method "
                             f"'mtp' on DeepSeek-V4.1, not {self.method!r}")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={self.method!r}; choose one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model names the draft model: required for method 'draft_model' "
                             "and only for it")

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past a request's tokens the proposer writes KV into (its chain of drafts); n-gram writes none."""
        return 0 if self.method == "ngram" else self.num_speculative_tokens

    def check_target(self, model: ModelConfig, parallel: ParallelConfig) -> None:
        """Start-up checks against the target: the method must have what it needs (MTP layers, a draft with the
        target's vocabulary)."""
        # Tensor parallel: every rank of the replica verifies the same drafts (the scheduler's) against the same
        # all-gathered logits and takes its first rank's accepted tokens (ModelRunner._take_driver_tokens); a
        # proposer with weights runs on every rank over its TP-sharded layers. Data parallel: each replica drafts
        # and verifies its own requests; replicas in lockstep (expert parallel) pad the proposer's forwards with
        # dummies (proposers/__init__.py), which the MTP and DSpark proposers do and a draft model does not yet.
        if parallel.lockstep and self.method == "draft_model":
            raise ValueError(f"speculative_config.method='draft_model' with enable_expert_parallel and "
                             f"data_parallel_size={parallel.data_parallel_size} is not supported yet; use 'mtp' or "
                             "'ngram', or data_parallel_size=1")
        if self.method == "mtp":
            n = int(model.hf_config.get("num_nextn_predict_layers", 0) or 0)
            if n < 1:
                raise ValueError(f"speculative_config.method='mtp': {model.architecture or model.path} has no MTP "
                                 f"layers (num_nextn_predict_layers={n}); use 'ngram' or 'draft_model'")
        if self.method == "draft_model":
            cfg = Path(self.model) / "config.json"
            if not cfg.is_file():
                raise ValueError(f"speculative_config.model={self.model!r} has no config.json")
            vocab = json.loads(cfg.read_text()).get("vocab_size")
            if vocab != model.vocab_size:
                raise ValueError(f"speculative_config.model has vocab_size={vocab}, the target {model.vocab_size}: a "
                                 "draft model must share the target's vocabulary")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """JSON text, a dict or None (``"null"`` too) -> the config; unknown keys are an error naming them."""
        return _parse_json_config(cls, value, "speculative_config", ("method", "num_speculative_tokens"))


def _parse_json_config(cls, value, name: str, required: tuple[str, ...]):
    """A JSON-valued config option (``--speculative-config``, ``--kv-transfer-config``): JSON text, a dict, an
    instance or None (``"null"`` too) -> the config; unknown keys and missing required ones are errors naming them."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be JSON, got {value!r}: {e}") from None
        if value is None:
            return None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; known: {sorted(known)}")
    missing = [k for k in required if k not in value]
    if missing:
        raise ValueError(f"{name} needs " + " and ".join(repr(k) for k in required))
    return cls(**value)


KV_CONNECTORS = ("NixlConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# kv_connector_extra_config.send_type, spelled as vLLM's P2pNcclConnector spells its push/pull switch: "GET" - the
# decoder reads the producer's blocks (pull, vLLM NixlConnector's only mode); "PUT" - the decoder hands its own
# blocks to the producer, which writes into them (push).
KV_SEND_TYPES = ("GET", "PUT")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (vLLM's ``kv_transfer_config``): a KV connector moves finished prompts' KV
    between instances. A producer runs prompts for others (``do_remote_decode``) and holds their blocks until the
    reader says it is done or ``abort_request_timeout_s`` passes (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT); a consumer
    reads them (``do_remote_prefill``), and falls back to computing the prompt itself when a read fails or takes
    longer than ``load_timeout_s``. The side channel (handshake and block layout, ZeroMQ + msgspec) listens on
    ``side_channel_host:side_channel_port``; port 0 picks a free port, advertised in ``kv_transfer_params``, so
    instances on one host never collide. ``kv_connector_extra_config.send_type`` picks pull (``"GET"``, the
    default) or push (``"PUT"``) for the requests this instance decodes; a producer serves both."""

    kv_connector: str
    kv_role: str
    engine_id: str | None = None  # None: a fresh uuid per start
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    abort_request_timeout_s: float = 480.0
    load_timeout_s: float = 30.0
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config must be a JSON object, got {extra!r}")
        unknown = sorted(set(extra) - {"send_type"})
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config has unknown keys {unknown}; known: "
                             f"['send_type']")
        if extra.get("send_type", "GET") not in KV_SEND_TYPES:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.send_type={extra['send_type']!r}; choose "
                             f"one of {', '.join(KV_SEND_TYPES)}")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector={self.kv_connector!r}; choose one of "
                             f"{', '.join(KV_CONNECTORS)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role={self.kv_role!r}; choose one of {', '.join(KV_ROLES)}")
        if not isinstance(self.side_channel_port, int) or not 0 <= self.side_channel_port < 65536:
            raise ValueError(f"kv_transfer_config.side_channel_port must be in [0, 65535], got "
                             f"{self.side_channel_port!r}")
        for name in ("abort_request_timeout_s", "load_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"kv_transfer_config.{name} must be a number > 0, got {v!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def push(self) -> bool:
        """This instance, decoding, has the producer write into its blocks (send_type PUT) rather than read."""
        return self.kv_connector_extra_config.get("send_type", "GET") == "PUT"

    @classmethod
    def parse(cls, value: str | dict | KVTransferConfig | None) -> KVTransferConfig | None:
        """JSON text, a dict or None -> the config; unknown keys are an error naming them."""
        return _parse_json_config(cls, value, "kv_transfer_config", ("kv_connector", "kv_role"))


# native: files in a local folder (--kv-offloading-path DIR); redis: a Redis / Valkey server that instances share
# (--kv-offloading-path redis://host:port[/db]; openinfer's addition to vLLM's choices).
KV_OFFLOADING_BACKENDS = ("native", "redis")


@dataclass(frozen=True)
class KVOffloadConfig:
    """A second KV tier (vLLM's ``--kv-offloading-backend`` / ``--kv-offloading-size``): full blocks that leave the
    pool are kept in files under ``path`` (openinfer's own flag; default: a temporary folder removed at shutdown),
    at most ``size_gb`` GiB, and a prompt whose prefix is there is loaded instead of recomputed
    (distributed/kv_transfer/offload_*.py). ``native``: files on a local disk (vLLM's native backend keeps CPU
    memory; a tmpfs path is that). ``redis``: a Redis / Valkey server at ``path`` (a redis:// URL) shared by every
    instance of the same model and settings; the server's own memory policy bounds it."""

    size_gb: float
    backend: str = "native"
    path: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(f"kv_offloading_backend={self.backend!r}; choose one of "
                             f"{', '.join(KV_OFFLOADING_BACKENDS)}")
        v = self.size_gb
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"kv_offloading_size must be a number of GiB > 0, got {v!r}")
        if self.backend == "redis" and not (self.path or "").startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_offloading_backend='redis' needs kv_offloading_path=redis://host:port[/db] (the "
                             f"shared store's address), got {self.path!r}")

    @property
    def size_bytes(self) -> int:
        return int(self.size_gb * (1 << 30))

    def check_path(self) -> None:
        """At start-up: the folder exists (or can be made) and files can be written there (ValueError naming
        --kv-offloading-path otherwise), so a bad path fails before the model loads, not at the first store."""
        if self.path is None or self.backend != "native":
            return  # a shared store is reached at engine start (a clear error if it cannot be)
        import tempfile

        try:
            os.makedirs(self.path, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.path, prefix=".probe-"):
                pass
        except OSError as e:
            raise ValueError(f"kv_offloading_path={self.path!r} is not a writable folder: {e.strerror or e}") \
                from None


@dataclass(frozen=True)
class EngineConfig:
    """Built from ``EngineArgs.create_engine_config`` (engine_args.py), the one list of user settings."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    seed: int = 0
    attention_backend: AttentionBackend = AttentionBackend.SDPA
    structured_outputs_backend: str = "auto"  # auto | llguidance | xgrammar
    tokenizer_mode: str = "auto"  # auto (the chat template) | deepseek_v4 (chat_encoding/deepseek_v4.py)
    kv_transfer: KVTransferConfig | None = None
    kernel: KernelConfig = field(default_factory=KernelConfig)
    # Where the default sampling settings come from (vLLM's --generation-config): "auto" = the checkpoint's
    # generation_config.json, "vllm" = none (SamplingParams' own defaults), else a folder holding one.
    generation_config: str = "auto"
    kv_offload: KVOffloadConfig | None = None

    def __post_init__(self) -> None:
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(f"generation_config={self.generation_config!r}: give auto, vllm or a folder holding a "
                             f"generation_config.json")
        if not isinstance(self.attention_backend, AttentionBackend):
            raise ValueError(f"attention_backend must be an AttentionBackend, got {self.attention_backend!r} "
                             f"(AttentionBackend.parse reads 'auto', 'sdpa', 'reference')")
        if self.structured_outputs_backend not in ("auto", "llguidance", "xgrammar"):
            raise ValueError(f"structured_outputs_backend={self.structured_outputs_backend!r}; choose one of auto, "
                             f"llguidance, xgrammar")
        if self.tokenizer_mode not in ("auto", "deepseek_v4", "deepseek_v32"):
            raise ValueError(f"tokenizer_mode={self.tokenizer_mode!r}; choose one of auto, deepseek_v4, deepseek_v32")
        heads, tp = self.model.hf_config.get("num_attention_heads"), self.parallel.tensor_parallel_size
        if isinstance(heads, int) and heads % tp:  # as vLLM checks it: before any rank process starts
            raise ValueError(f"num_attention_heads={heads} is not divisible by tensor_parallel_size={tp}")
        if self.kv_transfer is not None:
            # Every rank runs its own connector worker side (its NIXL agent over its shard); the engine combines
            # their reports. Under external_launcher each rank is an engine of its own: nobody combines them.
            if self.parallel.executor_backend == "external_launcher":
                raise ValueError("kv_transfer_config with distributed_executor_backend='external_launcher' is not "
                                 "supported: use mp or ray (one engine drives every rank's connector)")
        if self.kv_offload is not None:
            # Any layout: tensor-parallel ranks store their own shards, data-parallel replicas keep their own
            # index, a drafter's KV groups go with the target's (engine/kv_tier.py).
            if not self.cache.enable_prefix_caching:
                raise ValueError("kv_offloading_size needs enable_prefix_caching: the tier is keyed by the prefix "
                                 "cache's block hashes")


def engine_config_to_json(config: EngineConfig) -> str:
    """The whole config as JSON (what a worker process is started with: no pickle crosses the boundary)."""
    m = config.model
    return json.dumps({
        "model": {"path": m.path, "hf_config": m.hf_config, "dtype": str(m.dtype).removeprefix("torch."),
                  "device": str(m.device), "max_model_len": m.max_model_len, "tokenizer_path": m.tokenizer_path,
                  "quantization": m.quantization},
        "cache": asdict(config.cache), "scheduler": asdict(config.scheduler), "parallel": asdict(config.parallel),
        "speculative": asdict(config.speculative) if config.speculative else None,
        "seed": config.seed, "attention_backend": config.attention_backend.value,
        "structured_outputs_backend": config.structured_outputs_backend, "tokenizer_mode": config.tokenizer_mode,
        "kv_transfer": asdict(config.kv_transfer) if config.kv_transfer else None,
        "kernel": asdict(config.kernel), "generation_config": config.generation_config,
        "kv_offload": asdict(config.kv_offload) if config.kv_offload else None,
    })


def engine_config_from_json(text: str) -> EngineConfig:
    import torch

    d = json.loads(text)
    m = d["model"]
    model = ModelConfig(path=m["path"], hf_config=m["hf_config"], dtype=getattr(torch, m["dtype"]),
                        device=torch.device(m["device"]), max_model_len=m["max_model_len"],
                        tokenizer_path=m["tokenizer_path"], quantization=m.get("quantization"))
    return EngineConfig(model=model, cache=CacheConfig(**d["cache"]), scheduler=SchedulerConfig(**d["scheduler"]),
                        parallel=ParallelConfig(**d["parallel"]),
                        speculative=SpeculativeConfig.parse(d.get("speculative")), seed=d["seed"],
                        attention_backend=AttentionBackend(d["attention_backend"]),
                        structured_outputs_backend=d.get("structured_outputs_backend", "auto"),
                        tokenizer_mode=d.get("tokenizer_mode", "auto"),
                        kv_transfer=KVTransferConfig.parse(d.get("kv_transfer")),
                        kernel=KernelConfig(**d["kernel"]) if d.get("kernel") else KernelConfig(),
                        generation_config=d.get("generation_config", "auto"),
                        kv_offload=KVOffloadConfig(**d["kv_offload"]) if d.get("kv_offload") else None)
