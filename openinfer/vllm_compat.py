"""vLLM's ``vllm serve`` flags and ``LLM(...)`` keywords, each mapped once to what openinfer does with it.

One table, ``VLLM_FLAGS``, keyed by vLLM's long flag (vLLM's current names: ``vllm/engine/arg_utils.py`` and
``vllm/entrypoints/openai/cli_args.py``). Each entry is one of

- ``same``: openinfer has the setting under the same name with the same meaning (an ``EngineArgs`` field or a
  serve flag); the table adds vLLM's short forms (``-tp``) to it;
- ``alias``: openinfer has the capability under another name (``--num-gpu-blocks-override`` -> ``num_kv_blocks``);
- ``noop``: accepted, and one INFO line says why it changes nothing here (``--trust-remote-code``: openinfer runs
  no remote code);
- ``refuse``: "supported by vLLM, not by openinfer: --flag (why)", at parse time (exit 2) or as a ``ValueError``
  from ``LLM()``. Values listed in ``ok`` are what openinfer does anyway (``--pipeline-parallel-size 1``):
  those are accepted as a no-op.

``engine`` entries are also ``LLM()`` keywords (the flag's name in snake case); ``server`` entries exist only on
``openinfer serve``. The argparse of ``openinfer serve / generate / bench`` is generated from this table
(``add_vllm_flags``), and ``LLM()`` reads it through ``split_llm_kwargs``. Pure Python, no openinfer imports.
"""
from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

REFUSED = "supported by vLLM, not by openinfer: {flag} ({why})"
NOOPS_DEST = "_vllm_noops"  # where the no-op actions record what they accepted, for log_noops


def human_readable_int(value: str) -> int:
    """vLLM's integer parser for lengths: '32k' = 32,000, '32K' = 32,768 (binary suffixes take whole numbers)."""
    text = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if m is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer (e.g. 4096, 32k, 32K)") from None
    number, suffix = m.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"{value!r}: a binary suffix (K, M, G, T) takes a whole number")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


def _bytes_to_gib(value: str | int) -> float:
    n = human_readable_int(value) if isinstance(value, str) else int(value)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"kv_cache_memory_bytes must be > 0, got {value!r}")
    return n / (1 << 30)


@dataclass(frozen=True)
class VllmFlag:
    name: str  # vLLM's long flag
    kind: str  # same | alias | noop | refuse
    scope: str = "engine"  # engine (also an LLM() keyword) | server (openinfer serve only)
    why: str = ""  # noop: the log line's reason; refuse: the error's
    short: tuple[str, ...] = ()  # vLLM's short forms
    dest: str | None = None  # alias: the openinfer setting it sets
    convert: Callable[[Any], Any] | None = None  # alias: vLLM's value -> openinfer's
    takes_value: bool = True  # noop / refuse: whether the flag reads a value
    negatable: bool = False  # vLLM's --x / --no-x pair: --no-x is openinfer's behaviour already (a no-op)
    ok: tuple[str, ...] = ()  # refuse: values that are openinfer's behaviour already (accepted as a no-op)

    @property
    def keyword(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


def same(name: str, scope: str = "engine", short: tuple[str, ...] = ()) -> VllmFlag:
    return VllmFlag(name, "same", scope, short=short)


def alias(name: str, dest: str, convert: Callable[[Any], Any], why: str, scope: str = "engine") -> VllmFlag:
    return VllmFlag(name, "alias", scope, why=why, dest=dest, convert=convert)


def noop(name: str, why: str, scope: str = "engine", takes_value: bool = False, negatable: bool = False,
         short: tuple[str, ...] = ()) -> VllmFlag:
    return VllmFlag(name, "noop", scope, why=why, takes_value=takes_value, negatable=negatable, short=short)


def refuse(name: str, why: str, scope: str = "engine", takes_value: bool = True, negatable: bool = False,
           ok: tuple[str, ...] = (), short: tuple[str, ...] = ()) -> VllmFlag:
    return VllmFlag(name, "refuse", scope, why=why, takes_value=takes_value, negatable=negatable, ok=ok,
                    short=short)


_NO_MM = "openinfer serves text-only models"
_NO_LORA = "LoRA adapters are not implemented"
_NO_HUB = "openinfer loads a local checkpoint folder; it downloads nothing"
_NO_GRAPHS = "openinfer captures no CUDA graphs and does not torch.compile the model"
_DP_EXTERNAL = "multi-node data parallelism is not implemented; --data-parallel-size runs its replicas here"
_NOT_YET_KV_TIER = "not yet: no host-memory KV tier in this build"

_TABLE: list[VllmFlag] = [
    # -- ModelConfig -------------------------------------------------------------------------------------------
    same("--model"),
    refuse("--runner", "openinfer runs generative models only", ok=("auto", "generate")),
    refuse("--convert", "openinfer converts no model into a pooling model", ok=("auto", "none")),
    refuse("--task", "openinfer runs generative models only", ok=("auto", "generate")),
    same("--tokenizer"),
    same("--tokenizer-mode"),
    noop("--trust-remote-code", "openinfer runs no code from the checkpoint: its model classes are its own",
         negatable=True),
    same("--dtype"),
    same("--seed"),
    refuse("--hf-config-path", "the config is read from the --model folder"),
    refuse("--allowed-local-media-path", _NO_MM),
    refuse("--allowed-media-domains", _NO_MM),
    refuse("--revision", _NO_HUB),
    noop("--code-revision", "openinfer runs no code from the checkpoint", takes_value=True),
    refuse("--rope-scaling", "the checkpoint's config.json is used as it is"),
    refuse("--rope-theta", "the checkpoint's config.json is used as it is"),
    refuse("--tokenizer-revision", _NO_HUB),
    same("--max-model-len"),
    same("--quantization", short=("-q",)),
    noop("--enforce-eager", _NO_GRAPHS + ": it always runs eagerly", negatable=True),
    refuse("--max-logprobs", "the logprobs cap is OpenAI's 20", ok=("20",)),
    refuse("--logprobs-mode", "logprobs are the model's raw log-probabilities", ok=("raw_logprobs",)),
    refuse("--disable-sliding-window", "sliding-window layers always use their window"),
    noop("--disable-cascade-attn", "openinfer has no cascade attention", negatable=True),
    refuse("--skip-tokenizer-init", "the engine detokenizes (stop strings, text output)"),
    refuse("--enable-prompt-embeds", "prompts are text or token ids"),
    same("--served-model-name", scope="server"),
    refuse("--config-format", "the config is a Hugging Face config.json", ok=("auto", "hf")),
    refuse("--hf-token", _NO_HUB),
    refuse("--hf-overrides", "the checkpoint's config.json is used as it is"),
    refuse("--pooler-config", "openinfer runs generative models only"),
    refuse("--override-pooler-config", "openinfer runs generative models only"),
    refuse("--logits-processor-pattern", "custom logits processors are not supported"),
    same("--generation-config"),
    refuse("--override-generation-config", "give the sampling settings per request"),
    refuse("--enable-sleep-mode", "there is no sleep / wake-up API", negatable=True),
    refuse("--model-impl", "openinfer runs its own model classes", ok=("auto",)),
    refuse("--override-attention-dtype", "attention runs in the model's dtype"),
    refuse("--logits-processors", "custom logits processors are not supported"),
    refuse("--io-processor-plugin", "there are no IO processor plugins"),
    # -- LoadConfig --------------------------------------------------------------------------------------------
    refuse("--load-format", "the weights load from safetensors (or a GGUF file)", ok=("auto", "safetensors")),
    refuse("--download-dir", _NO_HUB),
    noop("--safetensors-load-strategy", "openinfer memory-maps the safetensors files", takes_value=True),
    refuse("--model-loader-extra-config", "the loader has no extra settings"),
    refuse("--ignore-patterns", "every weight file of the folder is read"),
    noop("--use-tqdm-on-load", "openinfer shows no progress bar while loading", negatable=True),
    refuse("--pt-load-map-location", "the weights load from safetensors"),
    # -- structured outputs ------------------------------------------------------------------------------------
    same("--reasoning-parser", scope="server"),
    refuse("--structured-outputs-config", "use --structured-outputs-backend"),
    refuse("--guided-decoding-backend", "use --structured-outputs-backend (vLLM deprecated this flag too)"),
    refuse("--guided-decoding-disable-fallback", "deprecated in vLLM; no fallback backend here"),
    refuse("--guided-decoding-disable-any-whitespace", "deprecated in vLLM"),
    refuse("--guided-decoding-disable-additional-properties", "deprecated in vLLM"),
    # -- ParallelConfig ----------------------------------------------------------------------------------------
    same("--distributed-executor-backend"),
    refuse("--pipeline-parallel-size", "pipeline parallelism is not implemented", ok=("1",), short=("-pp",)),
    same("--tensor-parallel-size", short=("-tp",)),
    refuse("--decode-context-parallel-size", "decode context parallelism is not implemented", ok=("1",),
           short=("-dcp",)),
    same("--data-parallel-size", short=("-dp",)),
    refuse("--data-parallel-rank", _DP_EXTERNAL, short=("-dpn",)),
    refuse("--data-parallel-start-rank", _DP_EXTERNAL, short=("-dpr",)),
    refuse("--data-parallel-size-local", _DP_EXTERNAL, short=("-dpl",)),
    refuse("--data-parallel-address", _DP_EXTERNAL, short=("-dpa",)),
    refuse("--data-parallel-rpc-port", _DP_EXTERNAL, short=("-dpp",)),
    refuse("--data-parallel-backend", "data-parallel replicas run on the --distributed-executor-backend",
           ok=("mp",), short=("-dpb",)),
    refuse("--data-parallel-hybrid-lb", _DP_EXTERNAL, takes_value=False, negatable=True),
    same("--enable-expert-parallel"),
    refuse("--all2all-backend", "expert parallelism uses torch.distributed's all-to-all"),
    refuse("--enable-dbo", "dual batch overlap is not implemented", takes_value=False, negatable=True),
    refuse("--dbo-decode-token-threshold", "dual batch overlap is not implemented"),
    refuse("--dbo-prefill-token-threshold", "dual batch overlap is not implemented"),
    refuse("--disable-nccl-for-dp-synchronization", "data-parallel replicas are stepped by one engine",
           takes_value=False, negatable=True),
    same("--enable-eplb"),
    refuse("--eplb-config", "use --num-redundant-experts and --eplb-step-interval"),
    refuse("--expert-placement-strategy", "experts are placed in contiguous ranges", ok=("linear",)),
    same("--num-redundant-experts"),
    refuse("--eplb-window-size", "the balancer counts the tokens of every step since the last rebalance"),
    same("--eplb-step-interval"),
    refuse("--eplb-log-balancedness", "not implemented", takes_value=False, negatable=True),
    noop("--max-parallel-loading-workers", "each rank loads its own shard", takes_value=True),
    refuse("--ray-workers-use-nsight", "not implemented", takes_value=False, negatable=True),
    noop("--disable-custom-all-reduce", "openinfer has no custom all-reduce (torch.distributed's is used)",
         negatable=True),
    refuse("--worker-cls", "the worker class is openinfer's own"),
    refuse("--worker-extension-cls", "the worker class is openinfer's own"),
    refuse("--enable-multimodal-encoder-data-parallel", _NO_MM, takes_value=False),
    # -- CacheConfig -------------------------------------------------------------------------------------------
    same("--block-size"),
    same("--gpu-memory-utilization"),
    alias("--kv-cache-memory-bytes", "kv_cache_memory_gb", _bytes_to_gib, "--kv-cache-memory-gb in GiB"),
    noop("--swap-space", "openinfer preempts by recompute (as vLLM v1 does); it keeps no CPU swap space",
         takes_value=True),
    same("--kv-cache-dtype"),
    alias("--num-gpu-blocks-override", "num_kv_blocks", int, "--num-kv-blocks"),
    same("--enable-prefix-caching"),
    refuse("--prefix-caching-hash-algo", "blocks are hashed with openinfer's own chained hash"),
    refuse("--cpu-offload-gb", "weight offloading is not implemented", ok=("0",)),
    refuse("--calculate-kv-scales", "fp8 KV caches use scale 1.0", takes_value=False, negatable=True),
    refuse("--kv-sharing-fast-prefill", "not implemented", takes_value=False, negatable=True),
    refuse("--mamba-cache-dtype", "openinfer has no Mamba models"),
    refuse("--mamba-ssm-cache-dtype", "openinfer has no Mamba models"),
    refuse("--mamba-block-size", "openinfer has no Mamba models"),
    refuse("--kv-offloading-size", _NOT_YET_KV_TIER),
    refuse("--kv-offloading-backend", _NOT_YET_KV_TIER),
    # -- MultiModalConfig --------------------------------------------------------------------------------------
    refuse("--limit-mm-per-prompt", _NO_MM),
    refuse("--enable-mm-embeds", _NO_MM, takes_value=False, negatable=True),
    refuse("--media-io-kwargs", _NO_MM),
    refuse("--mm-processor-kwargs", _NO_MM),
    refuse("--mm-processor-cache-gb", _NO_MM),
    refuse("--disable-mm-preprocessor-cache", _NO_MM, takes_value=False),
    refuse("--mm-processor-cache-type", _NO_MM),
    refuse("--mm-shm-cache-max-object-size-mb", _NO_MM),
    refuse("--mm-encoder-tp-mode", _NO_MM),
    refuse("--mm-encoder-attn-backend", _NO_MM),
    refuse("--interleave-mm-strings", _NO_MM, takes_value=False, negatable=True),
    refuse("--skip-mm-profiling", _NO_MM, takes_value=False, negatable=True),
    refuse("--video-pruning-rate", _NO_MM),
    # -- LoRAConfig --------------------------------------------------------------------------------------------
    refuse("--enable-lora", _NO_LORA, takes_value=False, negatable=True),
    refuse("--max-loras", _NO_LORA),
    refuse("--max-lora-rank", _NO_LORA),
    refuse("--lora-extra-vocab-size", _NO_LORA),
    refuse("--lora-dtype", _NO_LORA),
    refuse("--max-cpu-loras", _NO_LORA),
    refuse("--fully-sharded-loras", _NO_LORA, takes_value=False, negatable=True),
    refuse("--default-mm-loras", _NO_LORA),
    # -- ObservabilityConfig -----------------------------------------------------------------------------------
    refuse("--show-hidden-metrics-for-version", "openinfer hides no deprecated metrics"),
    refuse("--otlp-traces-endpoint", "OpenTelemetry tracing is not implemented"),
    refuse("--collect-detailed-traces", "OpenTelemetry tracing is not implemented"),
    # -- SchedulerConfig ---------------------------------------------------------------------------------------
    same("--max-num-batched-tokens"),
    same("--max-num-seqs"),
    refuse("--max-num-partial-prefills", "one budget covers every prompt chunk of a step", ok=("1",)),
    refuse("--max-long-partial-prefills", "one budget covers every prompt chunk of a step", ok=("1",)),
    refuse("--long-prefill-token-threshold", "one budget covers every prompt chunk of a step", ok=("0",)),
    refuse("--num-lookahead-slots", "speculative decoding sizes its own lookahead", ok=("0",)),
    same("--scheduling-policy"),
    noop("--enable-chunked-prefill", "openinfer always chunks long prompts over steps (its scheduler has no "
         "prefill phase)"),
    refuse("--no-enable-chunked-prefill", "the scheduler always chunks prompts to the step's token budget",
           takes_value=False),
    refuse("--disable-chunked-mm-input", _NO_MM, takes_value=False, negatable=True),
    refuse("--scheduler-cls", "the scheduler is openinfer's own"),
    refuse("--external-parameters", "the scheduler is openinfer's own"),
    refuse("--disable-hybrid-kv-cache-manager", "one KV manager holds every group of a model", takes_value=False,
           negatable=True),
    noop("--async-scheduling", "openinfer schedules each step after the last one ends; the tokens are the same",
         negatable=True),
    # -- CompilationConfig -------------------------------------------------------------------------------------
    noop("--cudagraph-capture-sizes", _NO_GRAPHS, takes_value=True),
    noop("--cuda-graph-sizes", _NO_GRAPHS, takes_value=True),
    noop("--max-cudagraph-capture-size", _NO_GRAPHS, takes_value=True),
    noop("--compilation-config", _NO_GRAPHS, takes_value=True, short=("-O",)),
    # -- VllmConfig --------------------------------------------------------------------------------------------
    same("--speculative-config"),
    same("--kv-transfer-config"),
    same("--kv-events-config", scope="server"),
    refuse("--additional-config", "there are no platform plugins"),
    # -- engine logging ----------------------------------------------------------------------------------------
    noop("--disable-log-stats", "openinfer logs no periodic stats lines (/metrics has them)"),
    noop("--aggregate-engine-logging", "openinfer logs no periodic stats lines (/metrics has them)"),
    refuse("--enable-log-requests", "openinfer never logs prompts; --access-log logs each HTTP request line",
           takes_value=False, negatable=True),
    noop("--disable-log-requests", "openinfer never logs request contents", scope="engine"),
    # -- the OpenAI server (FrontendArgs) ----------------------------------------------------------------------
    same("--host", scope="server"),
    same("--port", scope="server"),
    refuse("--uds", "the server listens on TCP (--host / --port)", scope="server"),
    same("--uvicorn-log-level", scope="server"),
    noop("--disable-uvicorn-access-log", "the access log is off unless --access-log", scope="server",
         negatable=True),
    noop("--disable-access-log-for-endpoints", "the access log is off unless --access-log", scope="server",
         takes_value=True),
    refuse("--allow-credentials", "no CORS middleware", scope="server", takes_value=False, negatable=True),
    refuse("--allowed-origins", "no CORS middleware", scope="server"),
    refuse("--allowed-methods", "no CORS middleware", scope="server"),
    refuse("--allowed-headers", "no CORS middleware", scope="server"),
    same("--api-key", scope="server"),
    refuse("--ssl-keyfile", "no TLS: put a TLS-terminating proxy in front", scope="server"),
    refuse("--ssl-certfile", "no TLS: put a TLS-terminating proxy in front", scope="server"),
    refuse("--ssl-ca-certs", "no TLS: put a TLS-terminating proxy in front", scope="server"),
    refuse("--enable-ssl-refresh", "no TLS: put a TLS-terminating proxy in front", scope="server",
           takes_value=False, negatable=True),
    refuse("--ssl-cert-reqs", "no TLS: put a TLS-terminating proxy in front", scope="server"),
    refuse("--ssl-ciphers", "no TLS: put a TLS-terminating proxy in front", scope="server"),
    refuse("--root-path", "not implemented", scope="server"),
    refuse("--middleware", "no ASGI middleware plugins", scope="server"),
    refuse("--enable-request-id-headers", "not implemented", scope="server", takes_value=False, negatable=True),
    refuse("--disable-fastapi-docs", "not implemented", scope="server", takes_value=False, negatable=True),
    refuse("--h11-max-incomplete-event-size", "see --header-timeout-s and --max-body-bytes", scope="server"),
    refuse("--h11-max-header-count", "see --header-timeout-s and --max-body-bytes", scope="server"),
    refuse("--enable-offline-docs", "not implemented", scope="server", takes_value=False, negatable=True),
    refuse("--enable-flash-late-interaction", "openinfer runs generative models only", scope="server",
           takes_value=False, negatable=True),
    refuse("--data-parallel-supervisor-port", _DP_EXTERNAL, scope="server"),
    refuse("--dp-supervisor-probe-interval-s", _DP_EXTERNAL, scope="server"),
    refuse("--dp-supervisor-probe-timeout-s", _DP_EXTERNAL, scope="server"),
    refuse("--dp-supervisor-probe-failure-threshold", _DP_EXTERNAL, scope="server"),
    refuse("--lora-modules", _NO_LORA, scope="server"),
    same("--chat-template"),
    refuse("--chat-template-content-format", "message content reaches the template as a string",
           scope="server", ok=("auto", "string")),
    refuse("--trust-request-chat-template", "requests cannot bring their own chat template", scope="server",
           takes_value=False, negatable=True),
    refuse("--default-chat-template-kwargs", "give chat_template_kwargs per request", scope="server"),
    refuse("--response-role", "the answer's role is assistant", scope="server", ok=("assistant",)),
    refuse("--return-tokens-as-token-ids", "use the request's return_token_ids", scope="server",
           takes_value=False, negatable=True),
    noop("--enable-auto-tool-choice", "tool_choice=auto is always on, parsed with --tool-call-parser",
         scope="server", negatable=True),
    refuse("--exclude-tools-when-tool-choice-none", "not implemented", scope="server", takes_value=False,
           negatable=True),
    same("--tool-call-parser", scope="server"),
    refuse("--tool-parser-plugin", "the tool parsers are openinfer's own (--tool-call-parser)", scope="server"),
    refuse("--tool-server", "there are no built-in tool servers", scope="server"),
    refuse("--log-config-file", "use --log-level", scope="server"),
    noop("--max-log-len", "openinfer never logs prompts", scope="server", takes_value=True),
    noop("--enable-prompt-tokens-details", "usage always has prompt_tokens_details", scope="server",
         negatable=True),
    refuse("--enable-per-request-metrics", "not implemented", scope="server", takes_value=False, negatable=True),
    refuse("--enable-server-load-tracking", "see /health/ready's num_running and num_waiting", scope="server",
           takes_value=False, negatable=True),
    refuse("--enable-force-include-usage", "use stream_options.include_usage", scope="server",
           takes_value=False, negatable=True),
    refuse("--enable-tokenizer-info-endpoint", "there is no /tokenizer_info", scope="server", takes_value=False,
           negatable=True),
    refuse("--enable-log-outputs", "openinfer never logs outputs", scope="server", takes_value=False,
           negatable=True),
    refuse("--enable-log-deltas", "openinfer never logs outputs", scope="server", takes_value=False,
           negatable=True),
    refuse("--cohere-is-reasoning-model", "there is no Cohere route", scope="server", takes_value=False,
           negatable=True),
    refuse("--cohere-format", "there is no Cohere route", scope="server"),
    refuse("--log-error-stack", "error responses carry no stack", scope="server", takes_value=False,
           negatable=True),
    refuse("--tokens-only", "not implemented", scope="server", takes_value=False, negatable=True),
    refuse("--fingerprint-mode", "responses carry no system_fingerprint", scope="server", ok=("none",)),
    refuse("--fingerprint-value", "responses carry no system_fingerprint", scope="server"),
    refuse("--headless", "the engine and the server run together", scope="server", takes_value=False),
    refuse("--api-server-count", "one API server process", scope="server", ok=("1",), short=("-asc",)),
    refuse("--config", "give the flags on the command line", scope="server"),
    refuse("--grpc", "the server speaks HTTP only", scope="server", takes_value=False),
]

VLLM_FLAGS: dict[str, VllmFlag] = {f.name: f for f in _TABLE}
assert len(VLLM_FLAGS) == len(_TABLE), "a vLLM flag is listed twice"


def short_forms(long_flag: str) -> tuple[str, ...]:
    """vLLM's short forms of a flag openinfer has under the same name (``--tensor-parallel-size`` -> ``-tp``)."""
    f = VLLM_FLAGS.get(long_flag)
    return f.short if f is not None and f.kind == "same" else ()


class _Noop(argparse.Action):
    """Accepts the flag (and its value, if it takes one); ``log_noops`` says why it changes nothing."""

    def __init__(self, option_strings, dest, flag: VllmFlag, **kw):
        self.flag = flag
        super().__init__(option_strings, dest=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        noted = getattr(namespace, NOOPS_DEST, None) or []
        noted.append((option_string, self.flag.why))
        setattr(namespace, NOOPS_DEST, noted)


class _Refuse(_Noop):
    """The flag is vLLM's and openinfer lacks what it asks for: exit 2 with the reason (a value in ``ok`` is
    openinfer's behaviour already: noted as a no-op instead)."""

    def __call__(self, parser, namespace, values, option_string=None):
        value = values[0] if isinstance(values, list) and values else values
        if self.flag.ok and value is not None and str(value) in self.flag.ok:
            super().__call__(parser, namespace, values, option_string)
            return
        parser.error(REFUSED.format(flag=option_string, why=self.flag.why))


class _Alias(argparse.Action):
    def __init__(self, option_strings, dest, flag: VllmFlag, **kw):
        self.flag = flag
        super().__init__(option_strings, dest=flag.dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            setattr(namespace, self.dest, self.flag.convert(values))
        except (ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"{option_string}: {e}")


def add_vllm_flags(parser: argparse.ArgumentParser, scopes: tuple[str, ...] = ("engine",)) -> None:
    """Register every ``alias`` / ``noop`` / ``refuse`` entry of ``scopes`` the parser does not define itself
    (``same`` entries are the parser's own flags). Call after the parser's own flags are added."""
    group = parser.add_argument_group("vLLM compatibility", "vLLM's flags, accepted (a no-op, logged), mapped "
                                      "onto openinfer's, or refused by name: docs/vllm_compat.md")
    taken = parser._option_string_actions  # live: grows as flags are added
    for f in _TABLE:
        if f.scope not in scopes or f.kind == "same" or f.name in taken:
            continue
        names = [n for n in (f.name, *f.short) if n not in taken]
        # refused flags stay out of --help (docs/vllm_compat.md lists them): they are there to be named in the error
        help_text = {"alias": f"vLLM's name of {f.why}", "noop": f"vLLM's; accepted, a no-op: {f.why}",
                     "refuse": argparse.SUPPRESS}[f.kind]
        if f.kind == "alias":
            group.add_argument(*names, action=_Alias, flag=f, help=help_text, metavar="VALUE")
            continue
        action = _Noop if f.kind == "noop" else _Refuse
        nargs = "?" if f.takes_value else 0
        group.add_argument(*names, action=action, flag=f, nargs=nargs, help=help_text,
                           **({"metavar": "VALUE"} if f.takes_value else {}))
        if f.negatable and "--no-" + f.name[2:] not in taken:
            group.add_argument("--no-" + f.name[2:], action=_Noop, nargs=0, help=argparse.SUPPRESS,
                               flag=VllmFlag(f.name, "noop", why="openinfer's behaviour already"))


def log_noops(args: argparse.Namespace) -> list[str]:
    """One INFO line per accepted no-op flag of this command line (returned too, for the tests)."""
    lines = [f"{flag}: accepted for vLLM compatibility, changes nothing here ({why})"
             for flag, why in getattr(args, NOOPS_DEST, None) or []]
    for line in lines:
        logger.info("%s", line)
    return lines


# -- LLM(...) -----------------------------------------------------------------------------------------------------
LLM_KEYWORDS: dict[str, VllmFlag] = {f.keyword: f for f in _TABLE if f.scope == "engine"}
# LLM()'s own keywords in vLLM that are no serve flag
LLM_KEYWORDS.update({
    "hf_token": refuse("--hf-token", _NO_HUB),
    "disable_log_stats": noop("--disable-log-stats", "openinfer logs no periodic stats lines"),
    "enforce_eager": noop("--enforce-eager", _NO_GRAPHS + ": it always runs eagerly"),
})


def split_llm_kwargs(kwargs: dict[str, Any], own_fields: set[str]) -> dict[str, Any]:
    """``LLM(**kwargs)`` as vLLM takes them -> openinfer's ``EngineArgs`` keywords: openinfer's own fields pass,
    vLLM's aliases are converted, no-ops are logged and dropped, refused ones raise ``ValueError`` by name (an
    unknown keyword passes on, for ``EngineArgs.from_kwargs`` to name with a hint)."""
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        f = LLM_KEYWORDS.get(key)
        negation = VLLM_FLAGS.get("--no-" + key.replace("_", "-"))
        if key in own_fields or f is None:
            out[key] = value
        elif value is False and negation is not None and negation.kind == "refuse":
            raise ValueError(REFUSED.format(flag=f"{key}=False", why=negation.why))
        elif f.kind == "alias":
            out[f.dest] = f.convert(value)
        elif f.kind == "noop" or (f.kind == "refuse" and (value is False or value is None
                                                          or str(value) in f.ok)):
            logger.info("LLM(%s=%r): accepted for vLLM compatibility, changes nothing here (%s)", key, value,
                        f.why or "openinfer's behaviour already")
        else:
            raise ValueError(REFUSED.format(flag=key, why=f.why))
    return out


def markdown_table() -> str:
    """The table as docs/vllm_compat.md shows it (the doc's test compares the two, so they cannot drift):
    ``python -c "from openinfer.vllm_compat import markdown_table; print(markdown_table())"``."""
    rows = ["| vLLM flag | `LLM()` keyword | openinfer |", "|---|---|---|"]
    for f in _TABLE:
        names = ", ".join(f"`{n}`" for n in (f.name, *f.short))
        keyword = f"`{f.keyword}`" if f.scope == "engine" and not f.name.startswith("--no-") else "(serve only)"
        what = {"same": "the same setting",
                "alias": f"mapped: {f.why}",
                "noop": f"accepted, logged no-op: {f.why}",
                "refuse": f"refused: {f.why}" + (f" (accepted: {', '.join(f.ok)})" if f.ok else "")}[f.kind]
        rows.append(f"| {names} | {keyword} | {what} |")
    return "\n".join(rows)
