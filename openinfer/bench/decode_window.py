"""Decode mode on openinfer: prefill ``batch`` requests untimed, then time exactly K steps of pure decode.

Driven through ``LLMEngine``'s public ``add_request`` / ``step`` / ``abort_request`` with DELTA outputs: each
step returns only the tokens it sampled, so reading them costs the timed window nothing e2e mode does not pay.

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
    from openinfer.sampling_params import RequestOutputKind

    max_model_len = engine.config.model.max_model_len
    longest = max(len(p) for p in prompts)
    # No max_tokens or min_tokens stop can fall inside the window: only the max_model_len cap, checked below.
    params = SamplingParams(temperature=temperature, max_tokens=max_model_len - longest, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine.reset_prefix_cache()
    preempt0 = engine.stats().num_preemptions
    ids: list[str] = []
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    finished: dict[str, str] = {}

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id].extend(t for c in out.outputs for t in c.token_ids)
            cached[out.request_id] = out.num_cached_tokens
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason if out.outputs else "?"

    try:
        for p in prompts:
            rid = engine.add_request(f"bench-decode-{next(_ids)}", {"prompt_token_ids": p}, params)
            ids.append(rid)
            tokens[rid] = []
        # Untimed prefill: every step computes at least one token, so this bound only trips on a stall.
        for _ in range(sum(len(p) for p in prompts) + len(prompts)):
            if all(tokens[i] for i in ids):
                break
            step()
            _check(engine, ids, finished, preempt0, decode_steps, "prefill")
        else:
            raise RuntimeError("decode mode: prefill did not finish (engine made no progress)")
        start = [len(tokens[i]) for i in ids]
        # The last sampled token of each request is not in the KV yet: it is computed by the next step.
        context = [len(p) + n - 1 for p, n in zip(prompts, start)]
        t0 = time.perf_counter()
        for _ in range(decode_steps):
            step()  # sampled token ids come back to the host, so the device work is done here
        elapsed = time.perf_counter() - t0
        _check(engine, ids, finished, preempt0, decode_steps, "the timed window")
        # Each step adds at most one token per request: K more tokens each means all decoded in all K steps.
        short = [i for i, s in zip(ids, start) if len(tokens[i]) != s + decode_steps]
        if short:
            raise RuntimeError(f"decode mode: {len(short)} of {len(ids)} requests did not decode in every "
                               f"one of the {decode_steps} timed steps (--max-num-batched-tokens "
                               f"{engine.config.scheduler.max_num_batched_tokens} < batch {len(ids)}?)")
        window = [tokens[i][s:s + decode_steps] for i, s in zip(ids, start)]
        sample = IterationSample(
            elapsed_s=elapsed, num_output_tokens=len(ids) * decode_steps, num_input_tokens=0,
            cached_prompt_tokens=sum(cached.get(i, 0) for i in ids), num_preemptions=0,
            kv_context=(min(context), max(context)))
        return DecodeWindow(sample, start, window)
    finally:
        engine.abort_request(ids)  # untimed; frees the KV blocks for the next iteration


def _check(engine, ids: list[str], finished: dict[str, str], preempt0: int, decode_steps: int,
           phase: str) -> None:
    n = engine.stats().num_preemptions - preempt0
    if n:
        raise RuntimeError(
            f"decode mode: {n} preemption(s) during {phase}: the KV cache ({engine.stats().num_blocks} "
            f"blocks of {engine.config.cache.block_size}) does not hold {len(ids)} requests at this "
            f"context; raise --num-kv-blocks / --kv-cache-memory-gb or lower the batch")
    done = [i for i in ids if i in finished]
    if done:
        raise RuntimeError(
            f"decode mode: {len(done)} request(s) finished during {phase} ({finished[done[0]]}); "
            f"--max-model-len {engine.config.model.max_model_len} leaves no room for {decode_steps} decode "
            f"steps after the prompt")
