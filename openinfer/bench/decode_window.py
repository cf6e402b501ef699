"""Decode mode on openinfer: prefill ``batch`` requests untimed, then time exactly K steps of pure decode.

Driven through ``LLMEngine``'s public ``add_request`` / ``step`` / ``abort_request``; the per-request token
counts are read from the scheduler's ``Request`` objects, because asking ``step()`` for per-step outputs
would copy every request's tokens on each timed step (work e2e mode does not do).

What the window holds: the engine's default step mixes decodes with prefill chunks, so requests admitted in
the first prefill steps decode a few tokens while later ones still prefill. Timing starts only once every
request has its first token, so each timed step is a decode of all ``batch`` sequences; the KV each request
holds at the window's start is recorded (``kv_context_min/max``): exactly ``--context-len`` when the whole
batch prefills in one step, a few tokens more for the early requests otherwise.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from openinfer.bench.results import IterationSample

_ids = itertools.count()


@dataclass
class DecodeWindow:
    sample: IterationSample
    # Per request: the output index of the window's first token, and the K tokens sampled in the window.
    start_index: list[int]
    tokens: list[list[int]]


def run_decode_window(engine, prompts: list[list[int]], decode_steps: int,
                      temperature: float) -> DecodeWindow:
    from openinfer import SamplingParams

    max_model_len = engine.config.model.max_model_len
    longest = max(len(p) for p in prompts)
    # No max_tokens or min_tokens stop can fall inside the window: only the max_model_len cap, checked below.
    params = SamplingParams(temperature=temperature, max_tokens=max_model_len - longest, ignore_eos=True)
    engine.reset_prefix_cache()
    preempt0 = engine.stats().num_preemptions
    ids: list[str] = []
    try:
        for p in prompts:
            ids.append(engine.add_request(f"bench-decode-{next(_ids)}", {"prompt_token_ids": p}, params,
                                          final_only=True))
        reqs = [engine.scheduler.requests[i] for i in ids]
        # Untimed prefill: every step computes at least one token, so this bound only trips on a stall.
        for _ in range(sum(len(p) for p in prompts) + len(prompts)):
            if all(r.num_output_tokens > 0 for r in reqs):
                break
            engine.step()
            _check(engine, reqs, preempt0, decode_steps, "prefill")
        else:
            raise RuntimeError("decode mode: prefill did not finish (engine made no progress)")
        start = [r.num_output_tokens for r in reqs]
        context = [r.num_computed_tokens for r in reqs]
        t0 = time.perf_counter()
        for _ in range(decode_steps):
            engine.step()  # sampled token ids come back to the host, so the device work is done here
        elapsed = time.perf_counter() - t0
        _check(engine, reqs, preempt0, decode_steps, "the timed window")
        # Each step adds at most one token per request: K more tokens each means all decoded in all K steps.
        short = [r.request_id for r, s in zip(reqs, start) if r.num_output_tokens != s + decode_steps]
        if short:
            raise RuntimeError(f"decode mode: {len(short)} of {len(reqs)} requests did not decode in every "
                               f"one of the {decode_steps} timed steps (--max-num-batched-tokens "
                               f"{engine.config.scheduler.max_num_batched_tokens} < batch {len(reqs)}?)")
        tokens = [list(r.output_token_ids[s:s + decode_steps]) for r, s in zip(reqs, start)]
        sample = IterationSample(
            elapsed_s=elapsed, num_output_tokens=len(reqs) * decode_steps, num_input_tokens=0,
            cached_prompt_tokens=sum(max(r.num_cached_tokens, 0) for r in reqs), num_preemptions=0,
            kv_context=(min(context), max(context)))
        return DecodeWindow(sample, start, tokens)
    finally:
        engine.abort_request(ids)  # untimed; frees the KV blocks for the next iteration


def _check(engine, reqs, preempt0: int, decode_steps: int, phase: str) -> None:
    n = engine.stats().num_preemptions - preempt0
    if n:
        raise RuntimeError(
            f"decode mode: {n} preemption(s) during {phase}: the KV cache ({engine.kv.pool.num_blocks} "
            f"blocks of {engine.config.cache.block_size}) does not hold {len(reqs)} requests at this "
            f"context; raise --num-kv-blocks / --kv-cache-memory-gb or lower the batch")
    done = [r for r in reqs if r.status.finished]
    if done:
        raise RuntimeError(
            f"decode mode: {len(done)} request(s) finished during {phase} ({done[0].status.value}); "
            f"--max-model-len {engine.config.model.max_model_len} leaves no room for {decode_steps} decode "
            f"steps after the prompt")
