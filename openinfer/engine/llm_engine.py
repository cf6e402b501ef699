"""The engine core: ``add_request`` / ``abort_request`` / ``step``. Offline ``LLM`` and the server both drive it.

``step()`` is schedule -> execute -> update; everything else (validation, detokenization, n > 1 fan-out) sits
around it. Every accepted request ends in exactly one outcome (finished, aborted, error) and gives its KV
blocks back.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

from openinfer.config import EngineConfig
from openinfer.engine.hybrid_kv_cache_manager import HybridKVCacheManager
from openinfer.engine.kv_cache_manager import KVCacheManager
from openinfer.engine.kv_groups import COARSE, FULL, WINDOW, KVGroupSpec, group, kv_startup_message
from openinfer.engine.output_processor import OutputProcessor
from openinfer.engine.request import Request, RequestStatus
from openinfer.engine.scheduler import Scheduler
from openinfer.executor.model_runner import ModelRunner
from openinfer.logging_utils import init_logging
from openinfer.outputs import RequestOutput
from openinfer.sampling_params import SamplingParams
from openinfer.tokenizer import default_sampling_params, eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


def build_kv_manager(groups: list[KVGroupSpec], blocks: dict[str, int], block_size: int,
                     enable_caching: bool) -> KVCacheManager:
    window = group(groups, WINDOW)
    if window is None:
        return KVCacheManager(blocks[FULL], block_size, enable_caching)
    coarse = group(groups, COARSE)
    return HybridKVCacheManager(blocks[FULL], blocks[WINDOW], block_size, window.lookback_tokens, enable_caching,
                                blocks.get(COARSE, 0), coarse.block_tokens if coarse is not None else None)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


class LLMEngine:
    def __init__(self, config: EngineConfig, chat_template: str | None = None) -> None:
        init_logging()
        self.config = config
        mc = config.model
        self.tokenizer = load_tokenizer(mc.tokenizer_path, chat_template)
        self.eos_token_ids = eos_token_ids(self.tokenizer, mc.path)
        self.runner = ModelRunner(config)
        blocks = self.runner.init_kv_cache()
        bs = config.cache.block_size
        groups = self.runner.kv_groups()
        self.kv = build_kv_manager(groups, blocks, bs, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._pending_children: dict[str, list[Request]] = {}  # parent id -> children waiting for a shared prefix
        self._ids = itertools.count()
        self.kv_bytes_per_token = self.runner.kv_bytes_per_token()
        self.startup_message = kv_startup_message(groups, blocks, bs, mc.max_model_len)
        logger.info(self.startup_message)

    # -- intake ----------------------------------------------------------------------------------
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

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_s: float | None = None, final_only: bool = False) -> str:
        """Validate and enqueue; raises ValueError (and changes nothing) for bad input. With ``final_only``
        ``step()`` returns this request's output once, when it finishes (cumulative outputs every step cost
        a copy of all tokens so far per request per step)."""
        params = params or SamplingParams()
        params.validate()
        text, ids = self.tokenize_prompt(prompt)
        self.validate_prompt_ids(ids)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params.clone(eos_token_ids=self.eos_token_ids)
        max_len = self.config.model.max_model_len
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone(seed=params.seed + i)  # distinct yet reproducible samples
            cid = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(cid, ids, child_params, max_len, arrival_s))
        self._check_fits(children[0])
        self.output_processor.add(request_id, text, children, params, final_only)
        self.scheduler.add_request(children[0])
        if len(children) > 1:
            # The siblings join once the first has computed the prompt, so they hit its cached blocks
            # instead of computing the same prefix n times.
            if self.config.cache.enable_prefix_caching:
                self._pending_children[children[0].request_id] = children[1:]
            else:
                for c in children[1:]:
                    self.scheduler.add_request(c)
        return request_id

    def _check_fits(self, req: Request) -> None:
        bs = self.config.cache.block_size
        need = -(-(req.num_prompt_tokens + req.max_tokens) // bs)
        if need > self.kv.pool.num_blocks:
            raise ValueError(
                f"request needs up to {need} KV blocks ({req.num_prompt_tokens} prompt + {req.max_tokens} new "
                f"tokens) but the whole KV cache has {self.kv.pool.num_blocks} blocks; lower max_tokens or grow "
                f"the cache"
            )

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outs = []
        for rid in request_ids:
            for cid in self.output_processor.child_ids(rid):
                pending = self._pending_children.pop(cid, [])
                self.scheduler.finish_requests([cid], RequestStatus.FINISHED_ABORTED)
                for c in pending:
                    self.output_processor.finish_externally(c.request_id, "abort")
                out = self.output_processor.finish_externally(cid, "abort")
                if out is not None and out.finished:
                    outs.append(out)
        return outs

    # -- the step --------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending_children)

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        try:
            result = self.runner.execute(sched)
        except Exception:
            # A failed forward must not strand requests: each scheduled one ends with an error and its
            # blocks return to the pool; the engine keeps serving the rest.
            logger.exception("model step failed; finishing %d requests with an error", len(sched.seqs))
            ids = [s.request_id for s in sched.seqs]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            ids += [c.request_id for i in ids for c in self._pending_children.pop(i, [])]
            outs = [self.output_processor.finish_externally(i, "error") for i in ids]
            return [o for o in outs if o is not None and o.finished]
        core_outputs = self.scheduler.update_from_output(sched, result)
        outputs, to_stop = self.output_processor.process(core_outputs)
        if to_stop:
            self.scheduler.finish_requests(to_stop, RequestStatus.FINISHED_STOPPED)
        for o in core_outputs:
            if o.new_token_ids and o.request_id in self._pending_children:
                for c in self._pending_children.pop(o.request_id):
                    self.scheduler.add_request(c)
        return outputs

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + sum(len(v) for v in self._pending_children.values()),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_blocks=kv.pool.num_blocks,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def default_sampling_params(self) -> SamplingParams:
        return default_sampling_params(self.config.model.path)
