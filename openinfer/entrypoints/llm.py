"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, sampling_params)``."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from openinfer import vllm_compat
from openinfer.engine.llm_engine import LLMEngine, PromptType
from openinfer.engine_args import EngineArgs
from openinfer.outputs import RequestOutput
from openinfer.sampling_params import RequestOutputKind, SamplingParams
from openinfer.tokenizer import apply_chat_template


def build_engine(engine_args: EngineArgs) -> LLMEngine:
    """The engine ``engine_args`` describe: the validated config, then the model, tokenizer and KV cache."""
    return LLMEngine(engine_args.create_engine_config(), chat_template=engine_args.chat_template)


class LLM:
    """``LLM(model, **engine_args)``: the keywords are exactly ``EngineArgs``'s fields (engine_args.py), e.g.
    ``LLM("path", dtype="float32", max_model_len=2048, memory_utilization=0.5)``; an unknown keyword is a
    ``TypeError`` naming it."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        # vLLM's keywords (openinfer/vllm_compat): mapped, accepted as a logged no-op, or refused by name
        kwargs = vllm_compat.split_llm_kwargs(kwargs, {f.name for f in fields(EngineArgs)})
        self.engine_args = EngineArgs.from_kwargs("LLM()", model=model, **kwargs)
        self.engine = build_engine(self.engine_args)
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``generate``. ``priority``: one value per prompt, lower first (needs
        ``scheduling_policy="priority"``, as in vLLM); ``lora_request`` is refused (no LoRA adapters)."""
        _refuse_lora(lora_request)
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                  and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling_params")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        for params in params_list:  # a bad grammar raises here, before any request is added
            self.engine.check_structured_outputs(params)
        ids = []
        try:
            for prompt, params, prio in zip(prompts, params_list, priorities):
                # One output per request, when it finishes: no per-step copies of whole token lists.
                params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                ids.append(self.engine.add_request(f"offline-{self._counter}", prompt, params, priority=prio))
                self._counter += 1
        except Exception:
            self.engine.abort_request(ids)  # all or nothing: a bad prompt leaves no stray requests
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: Any = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``chat``: ``chat_template_kwargs`` (e.g. ``{"thinking": True}``) and ``tools`` reach the chat
        template (or DeepSeek's encoder with ``tokenizer_mode``)."""
        _refuse_lora(lora_request)
        template_kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            template_kwargs["tools"] = tools
        if not messages:
            raise ValueError("messages must be a non-empty list")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": apply_chat_template(self.engine.tokenizer, conv, add_generation_prompt,
                                                     chat_template, self.engine.config.tokenizer_mode,
                                                     **template_kwargs)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    # vLLM's pooling and beam-search entry points: openinfer runs generative sampling only.
    def embed(self, *args: Any, **kwargs: Any):
        raise ValueError(vllm_compat.REFUSED.format(flag="LLM.embed", why="openinfer runs generative models only; "
                                                    "no pooling / embedding models"))

    def encode(self, *args: Any, **kwargs: Any):
        raise ValueError(vllm_compat.REFUSED.format(flag="LLM.encode", why="openinfer runs generative models only; "
                                                    "no pooling models"))

    def classify(self, *args: Any, **kwargs: Any):
        raise ValueError(vllm_compat.REFUSED.format(flag="LLM.classify", why="openinfer runs generative models "
                                                    "only; no classification models"))

    def score(self, *args: Any, **kwargs: Any):
        raise ValueError(vllm_compat.REFUSED.format(flag="LLM.score", why="openinfer runs generative models only; "
                                                    "no cross-encoder / scoring models"))

    def beam_search(self, *args: Any, **kwargs: Any):
        raise ValueError(vllm_compat.REFUSED.format(flag="LLM.beam_search", why="beam search is not implemented; "
                                                    "use n with sampling, or temperature=0"))

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        t0 = time.perf_counter()
        in_tokens = out_tokens = 0
        wanted = set(ids)
        while len(finished) < len(ids) and self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted and out.request_id not in finished:
                    finished[out.request_id] = out
                    if bar is not None:
                        in_tokens += len(out.prompt_token_ids)
                        out_tokens += sum(len(o.token_ids) for o in out.outputs)
                        dt = max(time.perf_counter() - t0, 1e-9)
                        bar.set_postfix_str(f"est. speed input: {in_tokens / dt:.1f} toks/s, "
                                            f"output: {out_tokens / dt:.1f} toks/s", refresh=False)
                        bar.update(1)
        if bar is not None:
            bar.close()
        missing = [i for i in ids if i not in finished]
        if missing:
            raise RuntimeError(f"engine stopped with {len(missing)} requests unfinished: {missing[:5]}")
        return [finished[i] for i in ids]


def _refuse_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError(vllm_compat.REFUSED.format(flag="lora_request", why="LoRA adapters are not implemented"))
