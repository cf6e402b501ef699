"""The engine as users drive it: ``add_request`` / ``abort_request`` / ``step``. Offline ``LLM`` and the server
both use it.

It turns prompts into validated ``EngineCoreRequest``\\ s (tokenize, check ids and limits, fan out ``n > 1``),
runs the engine core, and turns the core's deltas into ``RequestOutput``\\ s (detokenize, stop strings, fan in).
Bad input raises ``ValueError`` and changes nothing.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from PIL import Image

from openinfer.config import EngineConfig
from openinfer.engine.core import EngineCore, EngineDeadError, EngineStats
from openinfer.engine.output_processor import OutputProcessor
from openinfer.engine.parallel_sampling import ParentRequest
from openinfer.engine.request import RequestStatus, check_priority
from openinfer.kv_events import KVEventBatch
from openinfer.logging_utils import init_logging
from openinfer.multimodal.image_layout import VisionGeometry
from openinfer.multimodal.processor import expand_prompt
from openinfer.step_io import MMImage
from openinfer.outputs import RequestOutput
from openinfer.request_limits import DEFAULT_LIMITS, RequestLimits
from openinfer.sampling_params import SamplingParams
from openinfer.structured_outputs.backend import make_backend
from openinfer.structured_outputs.manager import GrammarCompiler
from openinfer.tokenizer import default_sampling_params, eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


class LLMEngine:
    def __init__(self, config: EngineConfig, chat_template: str | None = None) -> None:
        init_logging()
        self.config = config
        mc = config.model
        self.tokenizer = load_tokenizer(mc.tokenizer_path, chat_template)
        self.eos_token_ids = eos_token_ids(self.tokenizer, mc.path)
        backend = make_backend(config.structured_outputs_backend, self.tokenizer, mc.vocab_size,
                               sorted(self.eos_token_ids))
        self.grammar_compiler = GrammarCompiler(backend)
        self.core = EngineCore(config, grammar_compiler=self.grammar_compiler)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._held: dict[str, ParentRequest] = {}  # first child id -> its parent, while siblings are held back
        self._ids = itertools.count()
        # The caps add_request holds each request to (request_limits.py): the server puts its own here (--max-n,
        # --max-stop-strings, ...), so that a cap it raised is not refused again by the default one.
        self.request_limits: RequestLimits = DEFAULT_LIMITS
        logger.info(self.startup_message)

    # -- what the engine was built with --------------------------------------------------------------------
    @property
    def startup_message(self) -> str:
        return self.core.startup_message

    @property
    def kv_bytes_per_token(self) -> int:
        return self.core.kv_bytes_per_token

    @property
    def num_kv_blocks(self) -> dict[str, int]:
        return dict(self.core.num_kv_blocks)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.core.kv.token_capacity

    @property
    def load_time_s(self) -> float:
        return self.core.executor.load_time_s

    # -- intake ------------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate_prompt_ids(self, ids: list[int]) -> None:
        vocab = self.config.model.vocab_size
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        limit = self.config.model.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens, but max_model_len is {limit}: the prompt plus at "
                             f"least one generated token must fit")

    def place_images(self, prompt: PromptType, ids: list[int]) -> tuple[list[int], list[MMImage]]:
        """A prompt dict's ``multi_modal_data`` (vLLM's: ``{"image": PIL image or list of them}``) placed at its
        image placeholder tokens (multimodal/processor.py); the prompt unchanged without images."""
        placed = prompt.get("mm_images") if isinstance(prompt, dict) else None
        if placed:  # placed already (the server's chat path): each image must sit on placeholder positions
            token = VisionGeometry.from_hf(self.config.model.hf_config).image_token_id
            for m in placed:
                if m.offset < 0 or any(t != token for t in ids[m.offset:m.offset + m.length]) \
                        or m.offset + m.length > len(ids):
                    raise ValueError(f"an image placed at [{m.offset}, {m.offset + m.length}) is not on image "
                                     f"placeholder tokens (id {token})")
            return ids, list(placed)
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return ids, []
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"multi_modal_data takes only 'image', got {sorted(data) if isinstance(data, dict) else type(data).__name__}")
        images = data["image"] if isinstance(data["image"], list) else [data["image"]]
        if not images:
            return ids, []
        if not all(isinstance(i, Image.Image) for i in images):
            raise ValueError("multi_modal_data['image'] must be a PIL image or a list of them")
        mc = self.config.model
        limit = (mc.limit_mm_per_prompt or {}).get("image")
        if limit == 0:
            raise ValueError("image input is off for this engine (--limit-mm-per-prompt '{\"image\": 0}')")
        return expand_prompt(ids, images, VisionGeometry.from_hf(mc.hf_config), limit)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_s: float | None = None, priority: int = 0) -> str:
        """Validate and enqueue; raises ValueError (and changes nothing) for bad input. What ``step()`` returns
        for this request follows ``params.output_kind``. ``priority`` (vLLM's): lower is served first under the
        "priority" scheduling policy; any other value than 0 needs that policy, as in vLLM."""
        check_priority(priority, self.config.scheduler.policy)
        params = params or SamplingParams()
        params.validate()
        params.check_limits(self.config.model.vocab_size, self.request_limits)
        text, ids = self.tokenize_prompt(prompt)
        ids, mm_images = self.place_images(prompt, ids)
        self.validate_prompt_ids(ids)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival_s = time.monotonic() if arrival_s is None else arrival_s
        parent = ParentRequest(request_id, ids, params.clone(eos_token_ids=self.eos_token_ids,
                                                             bad_words_token_ids=self._bad_words_ids(params)),
                               arrival_s, share_prefix=self.config.cache.enable_prefix_caching, priority=priority,
                               mm_images=mm_images)
        initial = parent.initial()
        self.core.add_request(initial[0])  # raises if it can never fit; nothing is registered yet
        self.output_processor.add(parent, text, arrival_s)
        for child in initial[1:]:
            self.core.add_request(child)
        if parent.held_back:
            self._held[parent.first.request_id] = parent
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests (unknown or finished ids are ignored); returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outs = []
        for rid in request_ids:
            child_ids = self.output_processor.child_ids(rid)
            if not child_ids:
                continue
            self._held.pop(child_ids[0], None)
            self.core.abort_requests(child_ids)
            for cid in child_ids:
                out = self.output_processor.finish_externally(cid, "abort")
                if out is not None:
                    outs.append(out)
        return outs

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile (or find cached) the request's grammar now, blocking; ValueError naming the field when it
        cannot be used. The offline entrypoint calls it so a bad grammar raises instead of ending the request
        with an error; the server awaits ``grammar_compiler.submit`` off its event loop instead."""
        if params.structured_outputs is not None:
            self.grammar_compiler.compile(params.structured_outputs)

    def _bad_words_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word as token sequences, alone and after a space (vLLM's rule: a word mid-text usually
        tokenizes with its leading space)."""
        out: list[list[int]] = []
        for word in params.bad_words or []:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    # -- the step ----------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or bool(self._held)

    def step(self) -> list[RequestOutput]:
        try:
            core_outputs = self.core.step()
        except EngineDeadError:
            # The core already ended its requests; end them here too (held-back siblings included).
            self._held.clear()
            for rid in list(self.output_processor.parents):
                for cid in self.output_processor.child_ids(rid):
                    self.output_processor.finish_externally(cid, "error")
            raise
        outputs, to_stop, to_fail = self.output_processor.process(core_outputs)
        if to_stop:
            self.core.finish_requests(to_stop, RequestStatus.FINISHED_STOPPED)
        if to_fail:  # their detokenizing failed: they end (blocks back to the pool), the batch goes on
            self.core.finish_requests(to_fail, RequestStatus.FINISHED_ERROR)
        for o in core_outputs:
            parent = self._held.get(o.request_id)
            if parent is None:
                continue
            if o.new_token_ids:  # the first child's prompt blocks are cached: the siblings can share them
                del self._held[o.request_id]
                for child in parent.release():
                    self.core.add_request(child)
            elif o.finish_reason is not None:  # it ended before its first token: so do the siblings
                del self._held[o.request_id]
                for child in parent.release():
                    out = self.output_processor.finish_externally(child.request_id, o.finish_reason)
                    if out is not None:
                        outputs.append(out)
        return outputs

    # -- introspection -----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.core.stats()
        s.num_waiting += sum(len(p.held_back) for p in self._held.values())
        return s

    def reset_prefix_cache(self) -> int:
        return self.core.reset_prefix_cache()

    def enable_kv_events(self) -> None:
        self.core.enable_kv_events()

    def take_kv_events(self) -> list[KVEventBatch]:
        """KV cache events recorded since the last call (after ``enable_kv_events``), per data-parallel replica."""
        return self.core.take_kv_events()

    def default_sampling_params(self) -> SamplingParams:
        source = self.config.generation_config  # vLLM's --generation-config: auto | vllm | a folder
        if source == "vllm":
            return SamplingParams()
        return default_sampling_params(self.config.model.path if source == "auto" else source)

    def shutdown(self) -> None:
        self.core.shutdown()
        self.grammar_compiler.shutdown()
