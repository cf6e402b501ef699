"""Speculative decoding (vLLM's ``speculative_config``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from openinfer.config.json_option import parse_json_config
from openinfer.config.model import ModelConfig
from openinfer.config.parallel import ParallelConfig


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
        return parse_json_config(cls, value, "speculative_config", ("method", "num_speculative_tokens"))
