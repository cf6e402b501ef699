"""Decode mode on openinfer: prefill ``batch`` requests untimed, then time exactly K steps of pure decode.

Driven through ``LLMEngine``'s public ``add_request`` / ``step`` / ``abort_request`` with DELTA outputs: each
step returns only the tokens it sampled, so reading them costs the timed window nothing e2e mode does not pay.

What the window holds: the engine's default step mixes decodes with prefill chunks, so requests admitted in
the first prefill steps decode a few tokens while later ones still prefill. Timing starts only once every
request has its first token, so each timed step is a decode of all ``batch`` sequences; the KV each request
holds at the window's start is recorded (``kv_context_min/max``): exactly ``--context-len`` when the whole
batch prefills in one step, a few tokens more for the early requests otherwise.

With speculative decoding a step is one verification per request and adds 1 to 1 + k tokens to each; the
window is still K steps, every request must gain at least one token in each of them, and the sample carries
the tokens actually emitted and the drafts verified / accepted in the window.

``shared_prefix_len`` P: a priming request prefills the batch's common first P tokens (untimed) and finishes;
its blocks stay in the prefix cache, so each request of the batch hits them and prefills only its own tail.
The cache is then not reset between iterations: the prefix is the same for the whole sweep (a later priming
request hits it, or recomputes what was evicted), while the tails differ per request and per iteration. Every request still attends over its whole context in each timed step (its
block table lists the shared blocks), so the per-step KV read is the same as with distinct prompts; what is
saved is prefill time, and KV memory (the shared blocks are held once).
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
                      temperature: float, shared_prefix_len: int = 0) -> DecodeWindow:
    from openinfer import SamplingParams
    from openinfer.sampling_params import RequestOutputKind

    max_model_len = engine.config.model.max_model_len
    longest = max(len(p) for p in prompts)
    # No max_tokens or min_tokens stop can fall inside the window: only the max_model_len cap, checked below.
    params = SamplingParams(temperature=temperature, max_tokens=max_model_len - longest, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    if not shared_prefix_len:
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
        if shared_prefix_len:
            _prime_prefix(engine, prompts, shared_prefix_len)
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
        spec0 = engine.stats().spec_decode
        behind: set[str] = set()  # requests that gained no token in some timed step
        elapsed = 0.0
        for _ in range(decode_steps):
            before = [len(tokens[i]) for i in ids]
            t0 = time.perf_counter()
            step()  # sampled token ids come back to the host, so the device work is done here
            elapsed += time.perf_counter() - t0
            behind.update(i for i, n in zip(ids, before) if len(tokens[i]) == n)
        spec1 = engine.stats().spec_decode
        _check(engine, ids, finished, preempt0, decode_steps, "the timed window")
        if behind:
            raise RuntimeError(f"decode mode: {len(behind)} of {len(ids)} requests did not decode in every "
                               f"one of the {decode_steps} timed steps (--max-num-batched-tokens "
                               f"{engine.config.scheduler.max_num_batched_tokens} < batch {len(ids)}?)")
        window = [tokens[i][s:] for i, s in zip(ids, start)]
        drafts = (spec1.num_drafts - spec0.num_drafts, spec1.num_draft_tokens - spec0.num_draft_tokens,
                  spec1.num_accepted_tokens - spec0.num_accepted_tokens)
        sample = IterationSample(
            elapsed_s=elapsed, num_output_tokens=sum(len(t) for t in window), num_input_tokens=0,
            cached_prompt_tokens=sum(cached.get(i, 0) for i in ids), num_preemptions=0,
            kv_context=(min(context), max(context)), spec_drafts=drafts)
        return DecodeWindow(sample, start, window)
    finally:
        engine.abort_request(ids)  # untimed; frees the KV blocks for the next iteration


def _prime_prefix(engine, prompts: list[list[int]], n: int) -> None:
    """Prefill the batch's common first ``n`` tokens once, as a request of its own that stops after one token:
    its full blocks stay in the prefix cache for the batch to hit."""
    from openinfer import SamplingParams

    prefix = prompts[0][:n]
    if any(p[:n] != prefix for p in prompts):
        raise ValueError(f"shared_prefix_len {n}: the prompts do not share their first {n} tokens")
    rid = engine.add_request(f"bench-decode-prime-{next(_ids)}", {"prompt_token_ids": prefix},
                             SamplingParams(max_tokens=1, temperature=0.0))
    for _ in range(n + 1):  # every step computes at least one token
        if any(out.finished for out in engine.step() if out.request_id == rid):
            return
    engine.abort_request([rid])
    raise RuntimeError("decode mode: the shared-prefix priming request did not finish (engine made no progress)")


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
