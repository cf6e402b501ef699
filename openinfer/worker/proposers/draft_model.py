"""Draft-model proposer: a smaller model with the target's vocabulary drafts k tokens autoregressively, its KV in
the block manager as ``draft.<group>`` (drafting.py).

Each step, after the target has sampled:

1. catch-up: the draft computes every token the request has gained since its last step (a prompt chunk, or the
   accepted drafts plus the token sampled after them) in one forward; the logits at the newest token give draft 1;
2. chain: k - 1 single-token forwards, each on the previous draft, give drafts 2..k.

Drafts are the draft model's argmax (a deterministic proposer: verification treats its distribution as one-hot,
which keeps sampling exact; reporting the draft's probabilities would raise acceptance when sampling).
"""
from __future__ import annotations

import logging

import torch

from openinfer.config import EngineConfig, ModelConfig
from openinfer.forward_context import set_forward_context
from openinfer.layers.linear import prepack_linears
from openinfer.worker.input_batch import CachedRequestState
from openinfer.worker.loader import load_model
from openinfer.worker.proposers import ProposeInputs
from openinfer.worker.proposers.drafting import DraftingModel

logger = logging.getLogger(__name__)


class DraftModelProposer(DraftingModel):
    prefix = "draft."

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        model = load_model(draft_model_config(config.speculative.model, config.model), config.attention_backend,
                           device)
        model.use_kv_cache_dtype(config.cache.kv_cache_dtype)  # its stores as the target's (engine_args checked it)
        prepack_linears(model)
        super().__init__(model, config.speculative.num_speculative_tokens, config.model.max_model_len,
                         config.cache.block_size, device)

    def propose(self, step: ProposeInputs) -> dict[str, list[int]]:
        batch = step.batch
        gidx = self.group_rows(batch)
        # A row drafts only if its newest token has a KV slot (the scheduler's lookahead) and the context has room.
        sampled = {r.state.req_id for r in step.sampled
                   if len(r.state.token_ids) <= min(self.held(r.state, gidx, batch), self.max_model_len - 1)}
        # 1) catch-up over every row's new tokens; single-token rows first, as attention batches them.
        spans: list[tuple[CachedRequestState, int, int]] = []
        for r in step.rows:
            st = r.state
            if st.req_id in sampled:
                end = len(st.token_ids)
                begin = min(max(st.draft_computed, r.start), end - 1)  # at least the newest token: its logits
            else:
                end, begin = r.start + r.num_tokens, max(st.draft_computed, r.start)
            if end > begin:
                spans.append((st, begin, end))
        spans.sort(key=lambda s: s[2] - s[1] != 1)
        if not spans:
            return {}
        ids = [t for st, b, e in spans for t in st.token_ids[b:e]]
        md = self.metadata([e - b for _, b, e in spans], [e for _, _, e in spans], [st for st, _, _ in spans],
                           batch, gidx)
        with set_forward_context(md):
            hidden = self.module(torch.tensor(ids, dtype=torch.long, device=self.device), md.positions)
        for st, _, e in spans:
            st.draft_computed = e
        ends = torch.tensor([e - b for _, b, e in spans], device=self.device).cumsum(0) - 1
        rows = [i for i, (st, _, _) in enumerate(spans) if st.req_id in sampled]
        if not rows:
            return {}
        states = [spans[i][0] for i in rows]
        nxt = self.module.compute_logits(hidden[ends[rows]]).max(dim=-1).indices.tolist()
        drafts = {st.req_id: [t] for st, t in zip(states, nxt)}
        # 2) chain: draft j (j >= 1) goes in at position L - 1 + j.
        room = {st.req_id: self.room(st, len(st.token_ids) - 1, gidx, batch) for st in states}
        for j in range(1, self.k):
            live = [st for st in states if room[st.req_id] > j]
            if not live:
                break
            pos = [len(st.token_ids) - 1 + j for st in live]
            md = self.metadata([1] * len(live), [p + 1 for p in pos], live, batch, gidx)
            ids = torch.tensor([drafts[st.req_id][-1] for st in live], dtype=torch.long, device=self.device)
            with set_forward_context(md):
                h = self.module(ids, md.positions)
            for st, t in zip(live, self.module.compute_logits(h).max(dim=-1).indices.tolist()):
                drafts[st.req_id].append(t)
        return {rid: d[:room[rid]] for rid, d in drafts.items() if room[rid] > 0}


def draft_model_config(path: str, target: ModelConfig) -> ModelConfig:
    """The draft's ModelConfig (the target's dtype, device and context); a draft that cannot serve the target is
    a start-up error naming the field (SpeculativeConfig.check_target checks the vocabulary first)."""
    try:
        return ModelConfig.from_path(path, dtype=target.dtype, device=str(target.device),
                                     max_model_len=target.max_model_len)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
