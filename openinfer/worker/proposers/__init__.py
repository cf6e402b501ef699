"""Speculative-decoding proposers: what drafts the next tokens of each decoding request (config.SpeculativeConfig).

After the target's forward and sampling, the runner hands a proposer the step (``ProposeInputs``); it returns
``{request id: drafts}``, which the scheduler sends back for verification next step (rejection_sampler.py). A
proposer with weights also declares KV groups (``kv_cache_spec``): they live in the engine's block manager beside
the target's, named with the proposer's prefix, and share the target's block layout (so prefix caching, chunked
prefill and preemption treat them like any group)."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from openinfer.config import EngineConfig
    from openinfer.kv_cache_interface import KVGroupSpec
    from openinfer.worker.input_batch import InputBatch, ScheduledRow


@dataclass
class ProposeInputs:
    """One step, after sampling: every row the target computed (step order), the ones that sampled (their
    ``state.token_ids`` already end with this step's tokens), and the target's last hidden states [T, H]."""

    rows: list[ScheduledRow]
    sampled: list[ScheduledRow]
    hidden: torch.Tensor
    batch: InputBatch


class Proposer(abc.ABC):
    """What the runner calls. A proposer without weights keeps the default (no KV groups)."""

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
        return []

    def bind_kv_cache(self, num_blocks: dict[str, int], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        pass

    def free_kv_cache(self) -> None:
        pass

    def kv_stores(self) -> list[tuple[str, torch.Tensor | None]]:
        """(engine group name, store) of the proposer's bound KV, in a fixed order (models/interface.py's
        ``KVStores``): what a KV connector (PD transfer, the offloading tier) moves beside the target's stores."""
        return []

    # Forwards through collective layers (expert-parallel MoE) each step under data-parallel lockstep: every rank
    # runs exactly this many (``forwards`` of them real in the last ``propose``, the rest ``dummy_forward``), so
    # replicas with different accepted lengths, nothing to draft or no work at all meet in the same all-to-alls.
    lockstep_forwards: int = 0
    forwards: int = 0

    def dummy_forward(self, hidden: torch.Tensor, scratch: dict[str, int], batch: InputBatch) -> None:
        """One token through the drafting module on the scratch blocks (``scratch``: group -> block), ``hidden``
        a row of the target's hidden state of the step (or of its dummy forward); nothing is drafted."""
        raise NotImplementedError(f"{type(self).__name__} cannot step in data-parallel lockstep")

    @abc.abstractmethod
    def propose(self, step: ProposeInputs) -> dict[str, list[int]]:
        """``{request id: drafts}`` for the rows of ``step`` that sampled."""

    def confidence(self) -> dict[str, list[float]]:
        """The last ``propose``'s predicted acceptance per draft, for proposers that predict it (reported in the
        spec-decode stats; verification does not use it)."""
        return {}


def make_proposer(config: EngineConfig, device: torch.device, target: torch.nn.Module) -> Proposer | None:
    """The proposer ``config.speculative`` asks for (None without speculative decoding); ``target`` is the loaded
    target model (a family whose MTP layers load with it shares them)."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        from openinfer.worker.proposers.ngram import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        from openinfer.worker.proposers.draft_model import DraftModelProposer

        return DraftModelProposer(config, device)
    if spec.method == "mtp":
        from openinfer.models.registry import uses_dspark

        if uses_dspark(config.model.architecture):
            from openinfer.worker.proposers.dspark import DSparkProposer

            return DSparkProposer(config, device, target)
        from openinfer.worker.proposers.mtp import MtpProposer

        return MtpProposer(config, device, target)
    raise ValueError(f"speculative_config.method={spec.method!r} is not available")
