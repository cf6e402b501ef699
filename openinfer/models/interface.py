"""The contract between the worker's model runner and every model: one path for all of them, no probing.

A model is a ``CausalLM``: an ``nn.Module`` built as ``cls(hf_config, attention_backend=...)`` under the target
dtype and device (the loader sets both), filled by ``load_weights``, then given its KV cache by ``bind_kv_cache``.
Per step the runner sets the forward context (``openinfer.forward_context``: positions, per-KV-group block tables)
and calls ``forward``; layers read the tables of the groups the model declared in ``kv_cache_spec``.

``forward`` returns the model's last per-token state before its output head - what a speculative proposer
(DeepSeek MTP) consumes next to the sampled token - and ``compute_logits`` applies the head to the rows the
runner needs (sampled positions, prompt-logprob positions). For dense models and DeepSeek-V3 that state is the
final normed hidden state; for DeepSeek-V4 it is the mHC streams before ``hc_head``.

What a class can do beyond that is declared, typed, on the class (``CausalLM``'s class attributes, with their
defaults) and read as plain attributes by the engine's start-up checks and the worker: which ``--quantization``
methods and ``kv_cache_dtype``\\ s it has paths for, which parallel layouts give its one-process result, and how
speculative method ``mtp`` drafts for it (an ``MTPLayer`` class, or DSpark draft blocks loaded with it). The
registry checks every class it resolves against this contract (``check_model_class``, ``check_mtp_class``).

The KV stores a model owns are listed by ``kv_stores`` (group, tensor) in module order: what a KV connector
registers and transfers. The shared layers' ``Attention`` / ``MLAAttention`` are found by type; a model part
holding other stores (DeepSeek-V4 / V4.1 layer caches, V4.1's Engram ids) is a ``KVStoreOwner``.
"""
from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass
from abc import ABCMeta, abstractmethod
from collections.abc import Iterable, Mapping
from typing import ClassVar

import torch
from torch import nn

from openinfer.config import ParallelConfig
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.layers.attention import Attention
from openinfer.layers.mla import MLAAttention


class ParallelMode(enum.Enum):
    """A way of spreading one deployment over ranks (``ParallelConfig``)."""

    TENSOR = "tensor"  # tensor_parallel_size > 1: every layer split over the ranks (heads, MLP, vocabulary)
    DATA = "data"  # data_parallel_size > 1: whole replicas, each with its own requests
    EXPERT = "expert"  # enable_expert_parallel: routed experts split over all ranks (replicas in lockstep)


def parallel_modes(parallel: ParallelConfig) -> dict[ParallelMode, str]:
    """The modes a parallel config uses, each with the setting that asks for it (for error messages)."""
    used = {}
    if parallel.tensor_parallel_size > 1:
        used[ParallelMode.TENSOR] = f"tensor_parallel_size={parallel.tensor_parallel_size}"
    if parallel.data_parallel_size > 1:
        used[ParallelMode.DATA] = f"data_parallel_size={parallel.data_parallel_size}"
    if parallel.enable_expert_parallel:
        used[ParallelMode.EXPERT] = "enable_expert_parallel"
    return used


KVStores = list[tuple[str, "torch.Tensor | None"]]


class KVStoreOwner:
    """A model part (a layer's attention with its cache, a model's side store) whose paged stores are not the
    shared layers' ``Attention`` / ``MLAAttention`` caches: it lists them itself."""

    def kv_stores(self) -> KVStores:
        """(KV group, tensor whose first dimension is a block id of that group) per store, in a fixed order;
        nothing while unbound (or a None tensor, which the caller reports)."""
        raise NotImplementedError(f"{type(self).__name__} is a KVStoreOwner but does not list its stores")


def module_kv_stores(root: nn.Module) -> KVStores:
    """Every KV store under ``root``, in module order (the same on every instance of the same model and settings)."""
    stores: KVStores = []
    for m in root.modules():
        if isinstance(m, Attention):
            stores += [(m.kv_group, m.k_cache), (m.kv_group, m.v_cache)]
        elif isinstance(m, MLAAttention):
            stores.append((m.kv_group, m.kv_cache))
        elif isinstance(m, KVStoreOwner):
            stores += m.kv_stores()
    return stores


class CausalLM(nn.Module, metaclass=ABCMeta):
    """Base of every registered model class. The class attributes are its capabilities; the engine reads them as
    they are (no probing), so a class states anything it supports beyond these defaults."""

    # --quantization methods whose quantised linears (and experts) this model runs (engine_args checks).
    supported_quantization: ClassVar[tuple[str, ...]] = ()
    # kv_cache_dtype values with cache-write and read paths here; "auto" is the model's dtype.
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)
    # Parallel layouts that give the one-process result. Replicas (DATA) are whole models, right for any model;
    # TENSOR needs layers that split over the ranks, EXPERT MoE layers that place experts on ranks (a dense model
    # runs unchanged under it: its replicas only step in lockstep).
    supported_parallel_modes: ClassVar[frozenset[ParallelMode]] = frozenset({ParallelMode.DATA})
    # Speculative method "mtp" with DSpark draft blocks loaded with the model (a ``DSparkTarget``; proposers/dspark.py)
    # instead of an ``MTPLayer``.
    drafts_with_dspark: ClassVar[bool] = False

    @classmethod
    def mtp_layer_class(cls) -> type[MTPLayer] | None:
        """The class of this architecture's multi-token-prediction layer (speculative method "mtp"), or None."""
        return None

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] (the step's tokens, flat) -> [T, ...] state before the output head."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of ``forward``'s result -> logits [rows, vocab]."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume (checkpoint name, tensor) pairs; raise ``WeightLoadError`` naming what is missing or foreign."""

    def use_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """Told once after load, before ``kv_cache_spec``, the engine's ``kv_cache_dtype`` (one of
        ``supported_kv_cache_dtypes``). For a model whose values differ in more than the store dtype the runner
        hands over (DeepSeek-V4.1's DeepInfer layouts pick a format per store); the others need nothing here."""

    @abstractmethod
    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
        """The KV groups this model's layers read and write, with their exact bytes per block. ``dtype`` here and
        in ``bind_kv_cache`` is what the cache stores: the model's dtype, or float8_e4m3fn for kv_cache_dtype fp8
        (only for a class whose ``supported_kv_cache_dtypes`` lists it; engine_args checks)."""

    @abstractmethod
    def bind_kv_cache(self, num_blocks: Mapping[str, int], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        """Allocate every layer's stores for ``num_blocks`` blocks per group (replacing any earlier ones)."""

    @abstractmethod
    def free_kv_cache(self) -> None:
        """Drop the stores (the runner's warm-up uses a throwaway cache)."""

    def kv_stores(self) -> KVStores:
        """The bound stores, (group, tensor) in module order: the shared attention layers' caches and every
        ``KVStoreOwner``'s."""
        return module_kv_stores(self)


class MTPLayer(nn.Module, metaclass=ABCMeta):
    """A model's multi-token-prediction layer as a drafter (speculative method "mtp"; proposers/mtp.py). At
    position p it reads the target's ``forward`` state at p and the token at p + 1, and predicts p + 2; feeding
    its own output back drafts k > 1. Its KV groups are its own (the runner prefixes them).

    Built as ``cls(hf_config, index, attention_backend=...)`` and filled by ``load_weights`` from the checkpoint,
    or, where ``shares_target``, as ``cls(target, index)`` from the loaded target that holds its weights."""

    shares_target: ClassVar[bool] = False
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """input_ids [T]: the token after each position; hidden: the target's (or this layer's) state there."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]: ...

    @abstractmethod
    def bind_kv_cache(self, num_blocks: Mapping[str, int], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None: ...

    @abstractmethod
    def free_kv_cache(self) -> None: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """This layer's tensors of the checkpoint (required unless ``shares_target``)."""
        raise NotImplementedError(f"{type(self).__name__} loads no weights of its own (shares_target)")


@dataclass(frozen=True)
class DSparkShape:
    """What the DSpark proposer sizes its context-key store and checks its settings with."""

    draft_blocks: int  # draft blocks loaded with the model (0: the checkpoint has no mtp.* tensors)
    declared_blocks: int  # num_nextn_predict_layers, as the config declares
    max_draft_tokens: int  # dspark_block_size: the draft positions one block was trained for
    key_dim: int  # a context key's width, per draft block
    window: int  # the context tokens a draft reads (the sliding window)


class DSparkTarget(CausalLM):
    """A model whose DSpark draft blocks load with it and draft a whole block per step for speculative method "mtp"
    (proposers/dspark.py): the target's forward captures its layers' features, which become paged context keys."""

    drafts_with_dspark: ClassVar[bool] = True

    @abstractmethod
    def dspark_shape(self) -> DSparkShape: ...

    @abstractmethod
    def capture_dspark_features(self, on: bool) -> None:
        """While on, ``forward`` keeps the features of every token it computes (``dspark_features``)."""

    @abstractmethod
    def dspark_features(self) -> torch.Tensor | None:
        """The last forward's captured features, one row per token in step order."""

    @abstractmethod
    def dspark_context_keys(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Target features of tokens at ``positions`` -> their draft-block keys."""

    @abstractmethod
    def dspark_context_positions(self, accepted: torch.Tensor, window: int, k: int) -> torch.Tensor:
        """Accepted positions [B] -> the positions [B, window] whose keys a draft block of ``k`` reads (-1 before
        the sequence start)."""

    @abstractmethod
    def propose_over_keys(self, keys: torch.Tensor, ctx_pos: torch.Tensor, golden: torch.Tensor,
                          block_size: int | None = None, draw=None):
        """Draft tokens (and their confidence) over paged context keys; ``draw(logits [B, V], i)`` picks draft
        position i's tokens (default argmax)."""


# -- the checks the registry runs on every class it resolves -----------------------------------------------------
def _str_tuple(v: object) -> bool:
    return isinstance(v, tuple) and all(isinstance(x, str) for x in v)


def _modes(v: object) -> bool:
    return isinstance(v, frozenset) and all(isinstance(x, ParallelMode) for x in v)


def _bool(v: object) -> bool:
    return isinstance(v, bool)


# attribute -> (what its value must be, the test)
_MODEL_CAPABILITIES = {
    "supported_quantization": ("a tuple of str", _str_tuple),
    "supported_kv_cache_dtypes": ("a tuple of str", _str_tuple),
    "supported_parallel_modes": ("a frozenset of ParallelMode", _modes),
    "drafts_with_dspark": ("a bool", _bool),
}
_MTP_CAPABILITIES = {
    "shares_target": ("a bool", _bool),
    "supported_kv_cache_dtypes": ("a tuple of str", _str_tuple),
}


def _problems(cls: object, base: type, capabilities: dict) -> list[str]:
    if not isinstance(cls, type) or not issubclass(cls, base):
        return [f"it does not inherit openinfer.models.interface.{base.__name__}"]
    problems = []
    missing = sorted(cls.__abstractmethods__)
    if missing:
        problems.append(f"missing method(s) {', '.join(missing)}")
    for name, (what, ok) in capabilities.items():
        value = inspect.getattr_static(cls, name)
        if not ok(value):
            problems.append(f"{name} must be {what}, got {value!r}")
    return problems


def _raise(kind: str, cls: object, problems: list[str]) -> None:
    if problems:
        name = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)
        raise TypeError(f"{kind} {name} does not satisfy the model contract (openinfer/models/interface.py): "
                        f"{'; '.join(problems)}")


def check_model_class(cls: object) -> type[CausalLM]:
    """``cls`` if it is a complete ``CausalLM`` with well-typed capabilities, else a ``TypeError`` naming it and
    everything wrong."""
    problems = _problems(cls, CausalLM, _MODEL_CAPABILITIES)
    if not problems:
        if cls.drafts_with_dspark and not issubclass(cls, DSparkTarget):
            problems.append("drafts_with_dspark is set but it does not inherit DSparkTarget")
        if not isinstance(inspect.getattr_static(cls, "mtp_layer_class"), classmethod):
            problems.append("mtp_layer_class must be a classmethod")
    _raise("model class", cls, problems)
    return cls


def check_mtp_class(cls: object) -> type[MTPLayer]:
    """As ``check_model_class``, for an ``MTPLayer``; one that does not share the target loads its own weights."""
    problems = _problems(cls, MTPLayer, _MTP_CAPABILITIES)
    if not problems and not cls.shares_target and cls.load_weights is MTPLayer.load_weights:
        problems.append("missing method load_weights (required unless shares_target)")
    _raise("MTP layer class", cls, problems)
    return cls
