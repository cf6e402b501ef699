"""Draft-model proposer: a smaller model with the target's vocabulary drafts k tokens autoregressively.

Its KV cache is its own set of groups in the engine's block manager (``draft.<name>``), with the same block
positions as the target's, so whatever the scheduler does to a request's blocks (prefix hits, chunked prefill,
preemption, freeing) holds for the draft's KV as well. Each step, after the target has sampled:

1. catch-up: the draft computes every token the request has gained since its last step (a prompt chunk, or the
   accepted drafts plus the token sampled after them) in one forward; the logits at the newest token give draft 1;
2. chain: k - 1 single-token forwards, each on the previous draft, give drafts 2..k. Their KV rows lie past the
   request's known tokens, in the lookahead slots the scheduler allocates (``SchedulerConfig.num_lookahead_tokens``)
   and are overwritten by next step's catch-up.

Drafts are the draft model's argmax (a deterministic proposer: verification treats its distribution as one-hot,
which keeps sampling exact; reporting the draft's probabilities would raise acceptance when sampling).
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from openinfer.config import EngineConfig, ModelConfig
from openinfer.forward_context import AttentionMetadata, set_forward_context
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.layers.linear import prepack_linears
from openinfer.worker.input_batch import CachedRequestState
from openinfer.worker.loader import load_model
from openinfer.worker.proposers import ProposeInputs, Proposer

logger = logging.getLogger(__name__)

PREFIX = "draft."


class DraftModelProposer(Proposer):
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        spec = config.speculative
        target = config.model
        mc = draft_model_config(spec.model, target)
        self.model = load_model(mc, config.attention_backend, device)
        prepack_linears(self.model)
        self.k = spec.num_speculative_tokens
        self.max_model_len = target.max_model_len
        self.block_size = config.cache.block_size
        self.device = device
        self._groups: list[str] = []  # the draft model's own group names

    # -- KV cache: the draft's groups, renamed into the engine's namespace -------------------------------------
    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
        specs = self.model.kv_cache_spec(block_size, dtype)
        self._groups = [s.name for s in specs]
        return [replace(s, name=PREFIX + s.name) for s in specs]

    def bind_kv_cache(self, num_blocks: dict[str, int], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        self.model.bind_kv_cache({g: num_blocks[PREFIX + g] for g in self._groups}, block_size, dtype, device)

    def free_kv_cache(self) -> None:
        self.model.free_kv_cache()

    # -- one step ------------------------------------------------------------------------------------------
    def propose(self, step: ProposeInputs) -> dict[str, list[int]]:
        batch = step.batch
        gidx = {g: batch.group_names.index(PREFIX + g) for g in self._groups}
        # A row drafts only if its newest token has a KV slot (the scheduler's lookahead) and the context has room.
        sampled = {r.state.req_id for r in step.sampled
                   if len(r.state.token_ids) <= min(self._held(r.state, gidx, batch), self.max_model_len - 1)}
        # 1) catch-up over every row's new tokens; single-token rows first, as attention batches them.
        spans: list[tuple[CachedRequestState, int, int]] = []
        for r in step.rows:
            st = r.state
            end = len(st.token_ids) if st.req_id in sampled else r.start + r.num_tokens
            begin = min(max(st.draft_computed, r.start), end - 1) if st.req_id in sampled else \
                max(st.draft_computed, r.start)
            if end > begin:
                spans.append((st, begin, end))
        spans.sort(key=lambda s: s[2] - s[1] != 1)
        if not spans:
            return {}
        ids = [t for st, b, e in spans for t in st.token_ids[b:e]]
        md = self._metadata([e - b for _, b, e in spans], [e for _, _, e in spans], [st for st, _, _ in spans],
                            batch, gidx)
        with set_forward_context(md):
            hidden = self.model(torch.tensor(ids, dtype=torch.long, device=self.device), md.positions)
        for st, _, e in spans:
            st.draft_computed = e
        ends = torch.tensor([e - b for _, b, e in spans], device=self.device).cumsum(0) - 1
        rows = [i for i, (st, _, _) in enumerate(spans) if st.req_id in sampled]
        if not rows:
            return {}
        states = [spans[i][0] for i in rows]
        nxt = self.model.compute_logits(hidden[ends[rows]]).max(dim=-1).indices.tolist()
        drafts = {st.req_id: [t] for st, t in zip(states, nxt)}
        # 2) chain: each row drafts as far as k, its context and its allocated lookahead slots allow.
        room = {st.req_id: self._room(st, gidx, batch) for st in states}
        for j in range(1, self.k):
            live = [st for st in states if room[st.req_id] > j]
            if not live:
                break
            pos = [len(st.token_ids) - 1 + j for st in live]  # the previous draft's position
            md = self._metadata([1] * len(live), [p + 1 for p in pos], live, batch, gidx)
            ids = torch.tensor([drafts[st.req_id][-1] for st in live], dtype=torch.long, device=self.device)
            with set_forward_context(md):
                h = self.model(ids, md.positions)
            for st, t in zip(live, self.model.compute_logits(h).max(dim=-1).indices.tolist()):
                drafts[st.req_id].append(t)
        return {rid: d[:room[rid]] for rid, d in drafts.items() if room[rid] > 0}

    def _room(self, st: CachedRequestState, gidx: dict[str, int], batch) -> int:
        """Drafts worth making: at most k, none past the context or the request's remaining tokens, and every
        chain position inside the blocks the request holds (draft j's KV row is written at L - 1 + j). The
        scheduler trims by the same limits."""
        n = len(st.token_ids)
        held = self._held(st, gidx, batch)
        max_tokens = st.sampling_params.max_tokens
        left = self.k if max_tokens is None else max_tokens - len(st.output_token_ids) - 1
        return max(0, min(self.k, self.max_model_len - n - 1, held - n + 1, left))

    @staticmethod
    def _held(st: CachedRequestState, gidx: dict[str, int], batch) -> int:
        """Token positions the request's draft blocks cover."""
        return min(len(st.block_ids[i]) * batch.tokens_per_block[PREFIX + g] for g, i in gidx.items())

    def _metadata(self, query_lens: list[int], context_lens: list[int], states: list[CachedRequestState], batch,
                  gidx: dict[str, int]) -> AttentionMetadata:
        """The draft's forward context: its own group names over the engine's ``draft.*`` block tables."""
        return AttentionMetadata.build(
            query_lens, context_lens, {g: [st.block_ids[i] for st in states] for g, i in gidx.items()},
            {g: batch.tokens_per_block[PREFIX + g] for g in gidx}, self.block_size, self.device)


def draft_model_config(path: str, target: ModelConfig) -> ModelConfig:
    """The draft's ModelConfig (the target's dtype, device and context); a draft that cannot serve the target is
    a start-up error naming the field."""
    try:
        mc = ModelConfig.from_path(path, dtype=target.dtype, device=str(target.device),
                                   max_model_len=target.max_model_len)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    check_same_vocab(mc.hf_config, target)
    return mc


def check_same_vocab(draft_hf_config: dict, target: ModelConfig) -> None:
    if int(draft_hf_config.get("vocab_size", -1)) != target.vocab_size:
        raise ValueError(f"speculative_config.model has vocab_size={draft_hf_config.get('vocab_size')}, the target "
                         f"{target.vocab_size}: a draft model must share the target's vocabulary")
