"""What load balancers ask a worker, besides /health, /v1/models and /tokenize (api.py).

SGLang's router (and vllm-router, which grew out of it) queries ``/get_server_info``, ``/get_model_info`` and
``/get_load``; vllm-router's KV-aware policy reads the model and block size from vLLM's ``/server_info``. Each
answers from the engine's typed config and the core thread's latest ``StatsSnapshot``: nothing here touches the
engine (it is the core thread's alone).
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.responses import Response

from openinfer.server.serving import ServingContext, json_bytes


def _json(obj) -> Response:
    return Response(json_bytes(obj), media_type="application/json")


def load_info(ctx: ServingContext) -> list[dict]:
    """The engine's load now, one entry per data-parallel replica (``dp_rank``), as SGLang's ``/get_load``
    (``num_reqs`` = running + waiting, ``num_waiting_reqs``, ``num_tokens`` = KV tokens held in the replica's first
    KV group), with the same figures under vLLM's metric names."""
    s = ctx.async_engine.stats
    block_size = ctx.engine.config.cache.block_size
    ranks = s.rank_loads or [(s.num_running, s.num_waiting, s.num_free_blocks, s.num_blocks, s.kv_cache_usage)]
    return [{
        "dp_rank": rank,
        "num_reqs": running + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": (blocks - free) * block_size,
        "num_requests_running": running,
        "num_requests_waiting": waiting,
        "kv_cache_usage_perc": usage,
        "num_free_blocks": free,
        "num_total_blocks": blocks,
    } for rank, (running, waiting, free, blocks, usage) in enumerate(ranks)]


def server_info(ctx: ServingContext) -> dict:
    """The engine arguments a router or an operator needs to know (not the whole config: no paths to weights of
    other models, no secrets)."""
    from openinfer import __version__

    cfg = ctx.engine.config
    model, cache, sched, par = cfg.model, cfg.cache, cfg.scheduler, cfg.parallel
    return {
        "version": __version__,
        "model_path": model.path,
        "tokenizer_path": model.tokenizer_path,
        "served_model_name": ctx.model_name,
        "served_model_names": list(ctx.settings.served_model_names),
        "architectures": model.hf_config.get("architectures"),
        "dtype": str(model.dtype).removeprefix("torch."),
        "context_length": model.max_model_len,  # SGLang's name
        "max_model_len": model.max_model_len,
        "block_size": cache.block_size,
        "page_size": cache.block_size,  # SGLang's name
        "enable_prefix_caching": cache.enable_prefix_caching,
        "kv_capacity_tokens": ctx.kv_capacity_tokens,
        "max_total_num_tokens": ctx.kv_capacity_tokens,  # SGLang's name
        "max_num_seqs": sched.max_num_seqs,
        "max_running_requests": sched.max_num_seqs,  # SGLang's name
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_queue": ctx.settings.max_queue,
        "tp_size": par.tensor_parallel_size,
        "dp_size": par.data_parallel_size,
        "enable_expert_parallel": par.enable_expert_parallel,
        "speculative_method": cfg.speculative.method if cfg.speculative else None,
        "metrics_prefix": ctx.settings.metrics_prefix,
        "internal_states": load_info(ctx),
    }


def install_router_endpoints(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        return _json(server_info(ctx))

    @app.get("/server_info")
    async def vllm_server_info() -> Response:
        # vLLM's shape (``?config_format=json`` is what vllm-router sends; the answer is JSON either way).
        cfg = ctx.engine.config
        return _json({"vllm_config": {
            "model_config": {"model": ctx.model_name, "max_model_len": cfg.model.max_model_len,
                             "served_model_name": ctx.model_name, "tokenizer": cfg.model.tokenizer_path},
            "cache_config": {"block_size": cfg.cache.block_size,
                             "enable_prefix_caching": cfg.cache.enable_prefix_caching},
            "scheduler_config": {"max_num_seqs": cfg.scheduler.max_num_seqs,
                                 "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens},
            "parallel_config": {"tensor_parallel_size": cfg.parallel.tensor_parallel_size,
                                "data_parallel_size": cfg.parallel.data_parallel_size},
        }})

    @app.get("/model_info")  # sglang-router 0.3 asks this first, then falls back to /get_model_info
    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        cfg = ctx.engine.config
        return _json({
            "model_path": cfg.model.path,
            "tokenizer_path": cfg.model.tokenizer_path,
            "served_model_name": ctx.model_name,
            "model_id": ctx.model_name,
            "is_generation": True,
            "max_model_len": cfg.model.max_model_len,
            "architectures": cfg.model.hf_config.get("architectures"),
        })

    @app.get("/get_load")
    async def get_load() -> Response:
        return _json(load_info(ctx))
