"""Per-request sampling settings, shaped like vLLM's ``SamplingParams``."""
from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

from openinfer.request_limits import DEFAULT_LIMITS, INT64_MAX, RequestLimits, check_counts

MAX_LOGPROBS = 20  # OpenAI's cap on logprobs / top_logprobs; the server's checks use it too


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's names): everything so far (CUMULATIVE), only what
    is new since the previous one (DELTA: streaming, no per-step copies), or one output when it finishes
    (FINAL_ONLY: offline batches)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_MAX_LOGIT_BIAS = 100.0


@dataclass
class StructuredOutputsParams:
    """Constrain the output (vLLM's ``StructuredOutputsParams``): exactly one of a JSON schema (``json``, a dict or
    its JSON text), any JSON object (``json_object``), a ``regex``, one of the strings in ``choice``, a ``grammar``
    (Lark, or EBNF / GBNF), or a ``structural_tag`` (llguidance's / xgrammar's JSON format)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object, structural_tag; got {given or 'none'}")
        for name in ("json", "structural_tag"):
            v = getattr(self, name)
            if isinstance(v, str):
                try:
                    json.loads(v)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.{name} is not valid JSON: {e}") from None
            elif v is not None and not isinstance(v, dict):
                raise ValueError(f"structured_outputs.{name} must be a JSON object or its text, got "
                                 f"{type(v).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs.regex must be a string, got {type(self.regex).__name__}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")

    @property
    def kind(self) -> str:
        for k in ("json", "regex", "choice", "grammar", "structural_tag"):
            if getattr(self, k) is not None:
                return k
        return "json_object"

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): what compiled grammars are cached by."""
        v = {"json_object": None}.get(self.kind, getattr(self, self.kind))
        return self.kind, v if isinstance(v, str) else json.dumps(v, sort_keys=True)


def _short_repr(value: object, limit: int = 200) -> str:
    """repr for an error message: never a multi-MB echo of the request (long lists show their first items, ints
    too long to print their size)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, list) and len(value) > 5:
        return f"[{', '.join(_short_repr(v, 40) for v in value[:5])}, ... ({len(value)} items)]"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # token id -> bias added to its logit, in [-100, 100] (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (as words: with and without a leading space)
    structured_outputs: StructuredOutputsParams | None = None
    # Disaggregated prefill/decode (vLLM's kv_transfer_params, read by the engine's KV connector).
    kv_transfer_params: dict[str, Any] | None = None
    # Filled by the engine from the tokenizer / generation_config; not user-facing.
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            known = {"json", "regex", "choice", "grammar", "json_object", "structural_tag"}
            unknown = sorted(set(self.structured_outputs) - known)
            if unknown:
                raise ValueError(f"structured_outputs has unknown keys {unknown}; known: {sorted(known)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.logit_bias, dict):
            try:  # JSON object keys are strings; OpenAI sends token ids that way
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {list(self.logit_bias)!r}") from None
        self.validate()

    def validate(self) -> None:
        def bad(name: str, value: object, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {_short_repr(value)}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, v, "a finite number")
        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool):
                raise bad(name, v, "an integer, not a bool")
            # Past int64 a tensor (the sampler's top_k) or msgpack (the worker wire) cannot hold it: that would
            # fail a whole engine step, so it is the request's error here.
            if isinstance(v, int) and not -INT64_MAX - 1 <= v <= INT64_MAX:
                raise bad(name, v, "a 64-bit integer")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, ">= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0 (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not 0 < self.repetition_penalty <= 10:
            raise bad("repetition_penalty", self.repetition_penalty, "in (0, 10]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(name, v, f"an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, "a RequestOutputKind")
        if any(not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "non-negative token ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", self.logit_bias, "a mapping of token id -> bias")
            for k, v in self.logit_bias.items():
                if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= INT64_MAX:
                    raise bad("logit_bias", {k: v}, "keyed by non-negative token ids")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -_MAX_LOGIT_BIAS <= v <= _MAX_LOGIT_BIAS:
                    raise bad("logit_bias", {k: v}, f"biases in [-{_MAX_LOGIT_BIAS:g}, {_MAX_LOGIT_BIAS:g}]")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT64_MAX
                       for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", self.allowed_token_ids,
                      "a non-empty list of non-negative token ids")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or any(not isinstance(w, str) or not w for w in self.bad_words)):
            raise bad("bad_words", self.bad_words, "a list of non-empty strings")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams")
            self.structured_outputs.validate()
        if self.kv_transfer_params is not None:
            if not isinstance(self.kv_transfer_params, dict):
                raise bad("kv_transfer_params", self.kv_transfer_params, "a JSON object")
            if self.n != 1:
                raise ValueError(f"kv_transfer_params needs n=1 (one sequence's KV moves), got n={self.n}")

    def check_limits(self, vocab_size: int, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        """What ``validate`` cannot know: token ids the user named must exist in the model's vocabulary, and the
        request must stay within the configured caps (each costs the engine work per step or per token)."""
        check_counts(vocab_size, limits, n=self.n, stop=len(self.stop), stop_token_ids=len(self.stop_token_ids),
                     logit_bias=len(self.logit_bias or ()), allowed_token_ids=len(self.allowed_token_ids or ()),
                     bad_words=len(self.bad_words or ()))
        for name, ids in (("logit_bias", list(self.logit_bias or ())),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("stop_token_ids", self.stop_token_ids or [])):
            bad_ids = [t for t in ids if t >= vocab_size]
            if bad_ids:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad_ids[:5]}")
        for name, strs, cap in (("stop", self.stop, limits.max_stop_chars),
                                ("bad_words", self.bad_words or [], limits.max_bad_word_chars)):
            longest = max(strs, key=len, default="")
            if len(longest) > cap:
                raise ValueError(f"{name} has a string of {len(longest)} characters, more than the limit of {cap}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_token_constraints(self) -> bool:
        """logit_bias, allowed_token_ids or bad_words change this request's logits (the grammar mask is separate:
        it depends on the engine's matcher state, not on the params)."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    def clone(self, **changes: object) -> SamplingParams:
        from dataclasses import replace

        return replace(self, **changes)


# vLLM's SamplingParams fields openinfer lacks, with vLLM's default: passing the default asks for exactly what
# openinfer does (accepted), anything else is refused by name - never silently ignored.
_VLLM_ONLY_FIELDS: dict[str, tuple[object, str]] = {
    "best_of": (None, "use n"),
    "detokenize": (True, "outputs are always detokenized"),
    "spaces_between_special_tokens": (True, "special tokens are decoded with spaces between them"),
    "logits_processors": (None, "custom logits processors are not supported"),
    "truncate_prompt_tokens": (None, "a prompt longer than max_model_len is refused, not truncated"),
    "guided_decoding": (None, "use structured_outputs (vLLM deprecated guided_decoding too)"),
    "extra_args": (None, "only {'kv_transfer_params': ...} is understood"),
    "flat_logprobs": (False, "logprobs are one dict per token"),
    "skip_reading_prefix_cache": (None, "prefix caching is the engine's setting (enable_prefix_caching)"),
}

_dataclass_init = SamplingParams.__init__


def _init_refusing_vllm_fields(self, *args: Any, **kwargs: Any) -> None:
    extra = kwargs.get("extra_args")
    if isinstance(extra, dict) and set(extra) <= {"kv_transfer_params"}:  # where vLLM carries them
        kwargs.pop("extra_args")
        if "kv_transfer_params" in extra:
            kwargs.setdefault("kv_transfer_params", extra["kv_transfer_params"])
    for name, (default, why) in _VLLM_ONLY_FIELDS.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if value != default or type(value) is not type(default):
                raise ValueError(f"supported by vLLM, not by openinfer: SamplingParams.{name}={_short_repr(value)} "
                                 f"({why})")
    _dataclass_init(self, *args, **kwargs)


_init_refusing_vllm_fields.__doc__ = _dataclass_init.__doc__
SamplingParams.__init__ = _init_refusing_vllm_fields  # type: ignore[method-assign]
