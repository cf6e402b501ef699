"""``openinfer serve``: load the engine, then serve the OpenAI-compatible API with uvicorn.

SIGTERM drains: new requests get 503 while running ones finish (up to ``--drain-timeout-s``), then the process
exits 0. SIGINT does the same with no grace period; a second signal exits at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from openinfer import envs, vllm_compat
from openinfer.engine_args import EngineArgs
from openinfer.request_limits import RequestLimits
from openinfer.server.connections import ConnectionSettings, quiet_uvicorn_logs, raise_nofile_limit
from openinfer.server.health import HealthSettings

logger = logging.getLogger(__name__)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models, "
        "/health (and /ping), /health/ready, /metrics, /tokenize, /detokenize, /reset_prefix_cache.",
    )
    # vLLM's `vllm serve MODEL`: the model as a positional argument (the same as --model)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the same as --model (vLLM's form)")
    EngineArgs.add_cli_args(p)
    RequestLimits.add_cli_args(p)
    HealthSettings.add_cli_args(p)
    ConnectionSettings.add_cli_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key",
        nargs="+",
        default=[envs.API_KEY] if envs.API_KEY else None,
        help="require 'Authorization: Bearer KEY', any one of these keys (default: $OPENINFER_API_KEY)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use; the first is reported (default: the checkpoint directory's base name; "
        "the --model value is accepted too)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="sequences that may wait beyond --max-num-seqs before new requests get 429",
    )
    g.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="larger bodies get 413")
    g.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long running requests may take to finish before they are aborted",
    )
    g.add_argument(
        "--tool-call-parser",
        default="hermes",
        help="how this model writes tool calls: hermes (= qwen: <tool_call>{json}</tool_call>), deepseek_v3, "
        "deepseek_v32 / deepseek_v4 (DSML), or 'none' to "
        "answer requests with tools as plain text (default: hermes)",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        help="split thinking out of the answer into reasoning_content: deepseek_r1 / deepseek_v3 (the output "
        "starts inside <think>), deepseek_v4 (inside <think> in thinking mode: chat_template_kwargs thinking / "
        "enable_thinking; whole otherwise), qwen3 / think (only when the output opens <think>)",
    )
    g.add_argument(
        "--metrics-prefix",
        choices=("openinfer", "vllm"),
        default="openinfer",
        help="prefix of the /metrics names: vllm renders vLLM's exact names (vllm:num_requests_running, "
        "vllm:kv_cache_usage_perc ...) for dashboards and routers written for vLLM (default: openinfer)",
    )
    g.add_argument(
        "--kv-events-config",
        default=None,
        help="publish KV cache events for KV-aware routers, as JSON with vLLM's fields, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}\' '
        "(also replay_endpoint, buffer_steps, hwm, max_queue_size)",
    )
    g.add_argument("--uvicorn-log-level", default="warning")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    vllm_compat.add_vllm_flags(p, ("engine", "server"))  # vLLM's serve flags openinfer lacks: no-op or refused
    p.set_defaults(func=run)


def resolve_vllm_args(args: argparse.Namespace) -> list[str]:
    """What vLLM's serve line adds to openinfer's: the positional model, the checks vLLM makes, and one log line
    per accepted no-op flag (returned, for the tests). Runs before the (slow) engine load."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    accepted = [flag for flag, _ in getattr(args, vllm_compat.NOOPS_DEST, None) or []]
    if "--enable-auto-tool-choice" in accepted and args.tool_call_parser == "none":
        raise ValueError("--enable-auto-tool-choice needs a --tool-call-parser (got none)")
    return vllm_compat.log_noops(args)


def _base_name(path: str) -> str:
    """The id /v1/models shows by default: the checkpoint directory's name, not its path on this server."""
    return os.path.basename(os.path.normpath(path)) or path


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from openinfer.entrypoints.llm import build_engine
    from openinfer.kv_events import KVEventsConfig
    from openinfer.server.api import build_app
    from openinfer.server.runner import DrainingServer
    from openinfer.server.serving import ServerSettings

    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}")
    resolve_vllm_args(args)
    health = HealthSettings.from_cli_args(args)  # checked before the (slow) engine load
    connections = ConnectionSettings.from_cli_args(args)
    raise_nofile_limit()  # before the default --max-connections is derived from it
    kv_events = KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None
    engine_args = EngineArgs.from_cli_args(args)
    engine = build_engine(engine_args)
    print(engine.startup_message, file=sys.stderr, flush=True)
    names = args.served_model_name or [_base_name(args.model or engine.config.model.path)]
    settings = ServerSettings(
        served_model_names=names,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout_s,
        tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        limits=RequestLimits.from_cli_args(args),
        health=health,
        metrics_prefix=args.metrics_prefix,
        kv_events=kv_events,
        model_aliases=tuple(a for a in (args.model, engine.config.model.path) if a and a not in names),
    )
    app = build_app(engine, settings, engine_args.chat_template)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=args.drain_timeout_s + 10,
        lifespan="on",
        **connections.uvicorn_kwargs(),  # header / idle / keep-alive timeouts, connection cap, quiet loop
    )
    quiet_uvicorn_logs()  # after uvicorn.Config: it configures uvicorn's loggers
    server = DrainingServer(uv_config, app, args.drain_timeout_s)
    logger.info("serving %s on http://%s:%d", names[0], args.host, args.port)
    server.run()
    engine.shutdown()  # worker processes, when there are any
    # The server has shut down (drained, or after the engine died: exit code 1); skip the interpreter teardown
    # (seconds of torch module finalization) so a restart or a rolling deploy is not kept waiting.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(server.exit_code)
