"""The one request validator: every check a /v1/completions, /v1/chat/completions or /v1/messages request gets, and
the engine request (``AddRequest``: prompt token ids + ``SamplingParams``) built from what passes.

Two steps, because tokenizing sits between them and costs work proportional to the prompt:

1. ``check_completion`` / ``check_chat`` / ``check_messages`` take the parsed body (pydantic for the OpenAI routes,
   the decoded JSON for Anthropic's, which is first mapped onto a chat request) and run every check that does not
   need the prompt's token ids: the model, n and best_of, the caps on list fields, logprobs, the sampling ranges
   (the request's ``SamplingParams`` is built here, without its max_tokens), messages and their roles and
   contents, tools and tool_choice, the structured-output constraint (its grammar compiled last: the dearest
   check), the number of sequences against the server's capacity. They return a ``Checked*`` that says what to
   tokenize.
2. ``engine_request`` takes that and one prompt's token ids: the ids must be in the vocabulary and leave room in
   the context, max_tokens (or max_completion_tokens) is resolved against what is left, and the ``AddRequest``
   comes out.

Every failure is an ``APIError`` (400, ``param`` naming the field, the limit in the message), which the app
renders in OpenAI's error shape, or Anthropic's on /v1/messages (errors.py). The checks on a large body's raw bytes
(body_precheck.py) are a cheaper first copy of the size rules here and call them (``too_long``,
``check_prompt_chars``, ``check_num_sequences``, ``check_list_counts``), so their messages are the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from openinfer.request_limits import DEFAULT_LIMITS, RequestLimits, check_counts
from openinfer.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from openinfer.server.anthropic_request import anthropic_to_chat
from openinfer.server.chat_images import ChatImages, no_images
from openinfer.server.chat_tools import ToolPlan, check_tools
from openinfer.server.errors import APIError
from openinfer.server.messages import AddRequest
from openinfer.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, GenerationRequest
from openinfer.server.structured import compile_or_400, from_body
from openinfer.server.tool_parsers import ToolParser
from openinfer.step_io import MMImage
from openinfer.structured_outputs.manager import GrammarCompiler

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class CheckedRequest:
    """A request past every check that needs no token ids: what ``engine_request`` completes per prompt."""

    request: GenerationRequest  # as parsed (for /v1/messages: the chat request it was mapped onto)
    model: str  # the served name to answer with
    params: SamplingParams  # checked, max_tokens still None (it depends on the prompt's length)
    max_tokens: int | None  # as requested (>= 1), None: whatever room the prompt leaves
    max_tokens_param: str  # max_tokens | max_completion_tokens: the field a context-length error names
    prompt_param: str  # prompt | messages: the field a prompt error names


@dataclass
class CheckedCompletion(CheckedRequest):
    request: CompletionRequest
    prompts: list[str | list[int]] = field(default_factory=list)  # texts to tokenize, or token ids


@dataclass
class CheckedChat(CheckedRequest):
    request: ChatCompletionRequest
    plan: ToolPlan | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)  # as the chat template gets them
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs (+ the tools)
    images: list[Any] = field(default_factory=list)  # decoded PIL images, in the order of their placeholders


class RequestValidator:
    def __init__(
        self,
        *,
        served_model_names: list[str],
        max_model_len: int,
        vocab_size: int,
        kv_capacity_tokens: int,
        max_sequences: int,
        max_token_chars: int,
        model_aliases: tuple[str, ...] = (),
        limits: RequestLimits = DEFAULT_LIMITS,
        defaults: SamplingParams | None = None,
        tool_parser: type[ToolParser] | None = None,
        grammar_compiler: GrammarCompiler | None = None,
        images: ChatImages | None = None,
    ) -> None:
        self.images = images  # None: the model takes no images (an image part is a 400)
        self.served_model_names = list(served_model_names)
        self.model_aliases = tuple(model_aliases)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_sequences = max_sequences  # max_num_seqs + max_queue
        self.max_token_chars = max_token_chars
        # A text of more characters than this cannot fit max_model_len tokens: it is refused without tokenizing.
        self.max_prompt_chars = max_model_len * max_token_chars
        self.limits = limits
        self.defaults = defaults or SamplingParams()
        self.tool_parser = tool_parser
        self.grammar_compiler = grammar_compiler

    # -- the three APIs, step 1 -------------------------------------------------------------------------------
    async def check_completion(self, req: CompletionRequest) -> CheckedCompletion:
        model = self.check_model(req.model)
        self._check_generation(req)
        if req.suffix:
            raise APIError("suffix is not supported", 400, "suffix")
        self.check_logprobs("logprobs", req.logprobs)
        prompts = self._completion_prompts(req.prompt)
        if req.kv_transfer_params is not None and len(prompts) != 1:
            raise APIError(f"kv_transfer_params moves one prompt's KV; this request has {len(prompts)} prompts",
                           400, "kv_transfer_params")
        self.check_num_sequences(len(prompts), req.n)  # before tokenizing any of them
        requested = self._requested_max_tokens(req.max_tokens, "max_tokens")
        constraint = from_body(req.structured_outputs, None)
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = req.logprobs  # echoed prompt tokens come with their logprobs too
        params = self.sampling_params(req, req.logprobs, prompt_logprobs, constraint)
        await self._compile(constraint, "structured_outputs")
        return CheckedCompletion(req, model, params, requested, "max_tokens", "prompt", prompts=prompts)

    async def check_chat(self, req: ChatCompletionRequest) -> CheckedChat:
        model = self.check_model(req.model)
        self._check_generation(req)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise APIError("top_logprobs requires logprobs=true", 400, "top_logprobs")
            self.check_logprobs("top_logprobs", req.top_logprobs)
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError("continue_final_message and add_generation_prompt cannot both be true", 400,
                           "continue_final_message")
        self.check_num_sequences(1, req.n)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = self._requested_max_tokens(
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens, param)
        urls: list[tuple[Any, str]] = []
        messages = self.chat_messages(req.messages, self.images.placeholder if self.images else None, urls)
        if urls:
            self.images.check_count(len(urls))
        # decoding is CPU work: off the event loop
        images = [await asyncio.to_thread(self.images.read, url, where) for url, where in urls]
        # The template copies every message's text into the prompt: too many characters cannot fit the context,
        # and are refused before the template and the tokenizer spend time on them.
        self.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        plan = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser)
        constraint = from_body(req.structured_outputs, req.response_format)
        where = "structured_outputs" if req.structured_outputs is not None else "response_format"
        if plan is not None and plan.constraint is not None:
            if constraint is not None:
                raise APIError("tool_choice 'required' or a named function cannot be combined with a response "
                               "format", 400, "tool_choice")
            constraint, where = plan.constraint, "tools"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, logprobs, req.prompt_logprobs, constraint)
        await self._compile(constraint, where)
        template_kwargs = dict(req.chat_template_kwargs or {})
        if plan is not None:
            template_kwargs.setdefault("tools", plan.tools)
        return CheckedChat(req, model, params, requested, param, "messages", plan=plan, messages=messages,
                           template_kwargs=template_kwargs, images=images)

    async def check_messages(self, body: Any, count_only: bool = False) -> CheckedChat:
        """Anthropic's Messages API: the body mapped onto a chat request (``anthropic_to_chat``), then checked as
        one. ``count_only``: /v1/messages/count_tokens, where max_tokens is neither required nor used."""
        return await self.check_chat(anthropic_to_chat(body, count_only))

    # -- step 2: the engine request -------------------------------------------------------------------------
    def engine_request(self, checked: CheckedRequest, request_id: str, prompt_ids: list[int],
                       prompt: str | None = None, arrival_s: float | None = None,
                       mm_images: list[MMImage] | None = None) -> AddRequest:
        """One prompt's engine request: its ids checked, max_tokens resolved against the room they leave."""
        self.check_prompt_ids(prompt_ids, checked.prompt_param)
        max_tokens = self.resolve_max_tokens(checked.max_tokens, len(prompt_ids), checked.max_tokens_param)
        try:  # validated again whole: min_tokens <= max_tokens is the one rule that could not be checked before
            params = dataclasses.replace(checked.params, max_tokens=max_tokens)
        except (ValueError, TypeError) as e:
            raise _sampling_error(e) from None
        return AddRequest(request_id, prompt_ids, params, prompt, arrival_s, checked.request.priority,
                          list(mm_images or []))

    # -- the checks -------------------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> str:
        if name is None or name in self.served_model_names:
            return name or self.served_model_names[0]
        if name in self.model_aliases:
            return self.served_model_names[0]
        raise APIError(f"The model `{name}` does not exist. Served: {', '.join(self.served_model_names)}", 400,
                       "model", "model_not_found")

    def _check_generation(self, req: GenerationRequest) -> None:
        """What completions and chat share, each O(1): before any work on the request."""
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of is not supported (use n)", 400, "best_of")
        if not isinstance(req.n, int) or req.n < 1:
            raise APIError(f"n must be an integer >= 1, got {req.n}", 400, "n")
        self.check_list_counts(
            n=req.n, stop=1 if isinstance(req.stop, str) else len(req.stop or ()),
            stop_token_ids=len(req.stop_token_ids or ()), logit_bias=len(req.logit_bias or ()),
            allowed_token_ids=len(req.allowed_token_ids or ()), bad_words=len(req.bad_words or ()))
        self.check_logprobs("prompt_logprobs", req.prompt_logprobs)

    def check_list_counts(self, **counts: int) -> None:
        """n and the number of items in each capped list field (``request_limits.check_counts``)."""
        try:
            check_counts(self.vocab_size, self.limits, **counts)
        except ValueError as e:
            raise APIError(str(e), 400, str(e).split(" ", 1)[0]) from None

    @staticmethod
    def check_logprobs(name: str, value: int | None) -> None:
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise APIError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", 400, name)

    def check_num_sequences(self, num_prompts: int, n: int) -> None:
        """Before tokenizing anything: the request's sequences (prompts x n) must fit what the server holds."""
        if num_prompts * n > self.max_sequences:
            raise APIError(
                f"this request asks for {num_prompts * n} sequences ({num_prompts} prompt"
                f"{'' if num_prompts == 1 else 's'}, n={n}) but the server "
                f"holds at most {self.max_sequences} (max_num_seqs + max_queue)",
                400,
                "n" if num_prompts == 1 else "prompt",
            )

    @staticmethod
    def _completion_prompts(prompt: str | list) -> list[str | list[int]]:
        if isinstance(prompt, str):
            prompts = [prompt]
        elif not prompt:
            raise APIError("prompt must not be empty", 400, "prompt")
        else:
            prompts = [prompt] if isinstance(prompt[0], int) else list(prompt)
        if any(p == "" for p in prompts):
            raise APIError("prompt must be a non-empty string", 400, "prompt")
        return prompts

    def too_long(self, what: str, param: str) -> APIError:
        return APIError(
            f"This model's maximum context length is {self.max_model_len} tokens. However, {what}. Please reduce "
            f"the length of the input messages.",
            400,
            param,
            "context_length_exceeded",
        )

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse, without tokenizing, a text too long in characters to fit the context: no token of this
        tokenizer spans more than ``max_token_chars`` characters."""
        if num_chars > self.max_prompt_chars:
            raise self.too_long(
                f"your request has {num_chars} characters of input, more than the {self.max_prompt_chars} that "
                f"{self.max_model_len} tokens of this tokenizer can hold (at most {self.max_token_chars} "
                f"characters each)",
                param,
            )

    def check_prompt_ids(self, ids: list[int], param: str = "prompt") -> None:
        """Not empty, shorter than the context (one token must still fit), every id in the vocabulary."""
        if not ids:
            raise APIError("the prompt is empty (0 tokens)", 400, param)
        if len(ids) >= self.max_model_len:  # before looking at each id: a long list is refused at once
            raise self.too_long(f"your request has {len(ids)} input tokens", param)
        lo, hi = min(ids), max(ids)  # C loops, not a Python one per id
        if lo < 0 or hi >= self.vocab_size:
            raise APIError(
                f"token id {lo if lo < 0 else hi} is out of range: ids must be in [0, {self.vocab_size})", 400, param
            )

    @staticmethod
    def _requested_max_tokens(requested: int | None, param: str) -> int | None:
        if requested is not None and requested < 1:
            raise APIError(f"{param} must be at least 1, got {requested}", 400, param)
        return requested

    def resolve_max_tokens(self, requested: int | None, prompt_len: int, param: str = "max_tokens") -> int:
        """vLLM's strict rule: prompt + max_tokens must fit in max_model_len, else 400 with both numbers (the
        prompt alone fits: ``check_prompt_ids``)."""
        limit = self.max_model_len
        if requested is None:
            # Whatever room is left, but never more than the whole KV pool can hold.
            return max(1, min(limit, self.kv_capacity_tokens) - prompt_len)
        if prompt_len + requested > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the "
                f"completion). Please reduce the length of the messages or completion.",
                400,
                param,
                "context_length_exceeded",
            )
        return requested

    def sampling_params(self, req: GenerationRequest, logprobs: int | None, prompt_logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None) -> SamplingParams:
        """The request's sampling settings over the model's defaults: every range and cap checked, max_tokens left
        to ``engine_request``."""
        d = self.defaults

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        try:
            params = SamplingParams(
                n=req.n,
                temperature=pick(req.temperature, d.temperature),
                top_p=pick(req.top_p, d.top_p),
                top_k=pick(req.top_k, d.top_k),
                min_p=pick(req.min_p, d.min_p),
                seed=req.seed,
                presence_penalty=pick(req.presence_penalty, 0.0),
                frequency_penalty=pick(req.frequency_penalty, 0.0),
                repetition_penalty=pick(req.repetition_penalty, d.repetition_penalty),
                max_tokens=None,
                min_tokens=req.min_tokens,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                logit_bias=req.logit_bias,
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words,
                structured_outputs=structured_outputs,
                kv_transfer_params=req.kv_transfer_params,
            )
            params.check_limits(self.vocab_size, self.limits)
            return params
        except (ValueError, TypeError) as e:
            raise _sampling_error(e) from None

    async def _compile(self, constraint: StructuredOutputsParams | None, where: str) -> None:
        """The grammar compiled (off the event loop, cached) before the request is admitted: the last check,
        being the dearest. Without a compiler (a validator built for tests) the grammar is not checked."""
        if constraint is not None and self.grammar_compiler is not None:
            await compile_or_400(self.grammar_compiler, constraint, where)

    @staticmethod
    def chat_messages(messages: list[ChatMessage], image_placeholder: str | None = None,
                      image_urls: list[tuple[Any, str]] | None = None) -> list[dict[str, Any]]:
        """OpenAI chat messages as the chat template gets them (text parts joined). Like OpenAI: a known role, text
        (and, for a model that takes images, image_url) parts only, and a content on every message but an
        assistant's that carries tool_calls. An image_url part becomes ``image_placeholder`` in the text, its URL
        appended to ``image_urls`` with the field it came from."""
        if not messages:
            raise APIError("messages must be a non-empty list", 400, "messages")
        out = []
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise APIError(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {m.role!r}", 400,
                               f"messages.{i}.role")
            extra = m.model_extra or {}
            content = m.content
            if content is None and not (m.role == "assistant" and _has_tool_calls(extra)):
                why = " (an assistant message may leave it out only when it has tool_calls)" \
                    if m.role == "assistant" else ""
                raise APIError(f"Missing required parameter: 'messages[{i}].content'{why}", 400,
                               f"messages.{i}.content", "missing_required_parameter")
            if m.role == "tool":
                _require_str(extra.get("tool_call_id"), f"messages[{i}].tool_call_id")
            if m.role == "assistant" and isinstance(extra.get("tool_calls"), list):
                _check_tool_calls(extra["tool_calls"], i)
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type == "image_url" and m.role == "user":
                        where = f"messages[{i}].content[{j}].image_url"
                        if image_placeholder is None or image_urls is None:
                            raise no_images(where)
                        if not isinstance(part.image_url, dict):
                            raise APIError(f"Missing required parameter: '{where}' (an object with a url)", 400,
                                           f"messages.{i}.content.{j}.image_url", "missing_required_parameter")
                        image_urls.append((part.image_url.get("url"), f"{where}.url"))
                        texts.append(image_placeholder)
                        continue
                    if part.type != "text" or part.text is None:
                        raise APIError(f"messages[{i}]: only text (and image_url) content parts are supported, got "
                                       f"{part.type!r}",
                                       400, f"messages.{i}.content")
                    texts.append(part.text)
                content = "\n".join(texts)
            d: dict[str, Any] = {**extra, "role": m.role, "content": content or ""}
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out


def _require_str(value: Any, where: str) -> None:
    """OpenAI's answer to a required string field that is missing (or not a string): 400, naming it."""
    if not isinstance(value, str):
        param = where.replace("[", ".").replace("]", "")
        if value is None:
            raise APIError(f"Missing required parameter: '{where}'", 400, param, "missing_required_parameter")
        raise APIError(f"Invalid type for '{where}': expected a string, but got {type(value).__name__}", 400, param,
                       "invalid_type")


def _check_tool_calls(calls: list[Any], i: int) -> None:
    """An assistant message's tool_calls as OpenAI's schema requires them: each with id, type 'function' and a
    function with a name and its arguments (a JSON string)."""
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, dict):
            raise APIError(f"Invalid type for '{where}': expected an object", 400, f"messages.{i}.tool_calls.{j}",
                           "invalid_type")
        _require_str(call.get("id"), f"{where}.id")
        if call.get("type") != "function":
            raise APIError(f"Invalid value for '{where}.type': expected 'function', got {call.get('type')!r}", 400,
                           f"messages.{i}.tool_calls.{j}.type", "invalid_value")
        fn = call.get("function")
        if fn is None:
            raise APIError(f"Missing required parameter: '{where}.function'", 400,
                           f"messages.{i}.tool_calls.{j}.function", "missing_required_parameter")
        if not isinstance(fn, dict):
            raise APIError(f"Invalid type for '{where}.function': expected an object", 400,
                           f"messages.{i}.tool_calls.{j}.function", "invalid_type")
        _require_str(fn.get("name"), f"{where}.function.name")
        _require_str(fn.get("arguments"), f"{where}.function.arguments")


def _has_tool_calls(extra: dict[str, Any]) -> bool:
    """Whether an assistant message may leave out its content: OpenAI's rule, "required unless tool_calls or
    function_call is specified" (an empty tool_calls list is no tool call)."""
    calls = extra.get("tool_calls")
    return (isinstance(calls, list) and len(calls) > 0) or isinstance(extra.get("function_call"), dict)


def _sampling_error(e: Exception) -> APIError:
    """SamplingParams' ValueError (its message starts with the field) as a 400 naming that field."""
    msg = str(e)
    param = msg.split(" ", 1)[0] if msg else None
    if param and "." in param:  # structured_outputs.json: keep the field path, drop punctuation
        param = param.rstrip(":,")
    return APIError(msg, 400, param)
