"""MTP proposer: the target's own multi-token-prediction layer drafts k tokens (DeepSeek-V3's ``model.layers.{N}``),
its KV in the block manager as ``mtp.<group>`` (drafting.py).

The layer at position p reads the target's hidden state at p and the token at p + 1, and predicts p + 2. Each
step, after the target has sampled:

1. catch-up: every position whose hidden state the target produced this step and whose next token is now known
   (a prompt chunk; or the last known token, the accepted drafts, each followed by its successor - the newest,
   the token just sampled) goes through the layer in one forward. Its output at the last of them predicts the
   token after the newest: draft 1.
2. chain: draft j goes in at the next position with the layer's own output in place of the target's hidden state
   (DeepSeek reuses one MTP layer for k > 1 this way), k - 1 single-token forwards.

Drafts are the layer's argmax (deterministic: verification treats them as one-hot, which keeps sampling exact).
A prefix-cache hit reuses the MTP KV of the cached blocks; the entry at a block's last position was computed from
the token after the block, which another request sharing only the block may not have: its drafts can be worse,
never its output (verification decides).
"""
from __future__ import annotations

import torch

from openinfer.config import EngineConfig
from openinfer.forward_context import AttentionMetadata, set_forward_context
from openinfer.layers.linear import prepack_linears
from openinfer.worker.input_batch import CachedRequestState
from openinfer.worker.loader import load_mtp_layer
from openinfer.worker.proposers import ProposeInputs
from openinfer.worker.proposers.drafting import DraftingModel


class MtpProposer(DraftingModel):
    prefix = "mtp."

    def __init__(self, config: EngineConfig, device: torch.device, target: torch.nn.Module) -> None:
        layer = load_mtp_layer(config.model, 0, config.attention_backend, device, target)
        if not layer.shares_target:  # a shared layer was prepacked with the target
            prepack_linears(layer)
        super().__init__(layer, config.speculative.num_speculative_tokens, config.model.max_model_len,
                         config.cache.block_size, device)
        self.lockstep_forwards = self.k  # one catch-up forward, then at most k - 1 chain steps

    def dummy_forward(self, hidden: torch.Tensor, scratch: dict[str, int], batch) -> None:
        md = AttentionMetadata.build([1], [1], {g: [[scratch[self.prefix + g]]] for g in self._groups},
                                     {g: batch.tokens_per_block[self.prefix + g] for g in self._groups},
                                     self.block_size, self.device)
        md.is_dummy = True
        with set_forward_context(md):
            self.module(torch.zeros(1, dtype=torch.long, device=self.device), md.positions, hidden[:1])

    def propose(self, step: ProposeInputs) -> dict[str, list[int]]:
        self.forwards = 0
        batch = step.batch
        gidx = self.group_rows(batch)
        sampled = {r.state.req_id for r in step.sampled if len(r.state.token_ids) < self.max_model_len}
        # 1) catch-up: (state, first position, positions, the row's first hidden row); single-token spans first.
        spans: list[tuple[CachedRequestState, int, int, int]] = []
        off = 0
        for r in step.rows:
            st = r.state
            n = len(st.token_ids) - 1 - r.start if st.req_id in sampled else \
                min(r.num_tokens, len(st.token_ids) - 1 - r.start)
            if n > 0:
                spans.append((st, r.start, n, off))
            off += r.num_tokens
        spans.sort(key=lambda s: s[2] != 1)
        if not spans:
            return {}
        ids = [t for st, b, n, _ in spans for t in st.token_ids[b + 1:b + 1 + n]]
        rows = [h for _, _, n, o in spans for h in range(o, o + n)]
        md = self.metadata([n for _, _, n, _ in spans], [b + n for _, b, n, _ in spans], [s[0] for s in spans],
                           batch, gidx)
        with set_forward_context(md):
            out = self.module(torch.tensor(ids, dtype=torch.long, device=self.device), md.positions,
                              step.hidden[rows])
        self.forwards += 1
        last = torch.tensor([n for _, _, n, _ in spans], device=self.device).cumsum(0) - 1
        pick = [i for i, s in enumerate(spans) if s[0].req_id in sampled]
        if not pick:
            return {}
        states = [spans[i][0] for i in pick]
        prev = out[last[pick]]
        tokens = self.module.compute_logits(prev).max(dim=-1).indices
        drafts = {st.req_id: [t] for st, t in zip(states, tokens.tolist())}
        # 2) chain: draft j (j >= 1) goes in at position L - 2 + j (L: the request's known tokens).
        room = {st.req_id: self.room(st, len(st.token_ids) - 2, gidx, batch) for st in states}
        for j in range(1, self.k):
            live = [i for i, st in enumerate(states) if room[st.req_id] > j]
            if not live:
                break
            live_states = [states[i] for i in live]
            pos = [len(st.token_ids) - 2 + j for st in live_states]
            md = self.metadata([1] * len(live), [p + 1 for p in pos], live_states, batch, gidx)
            with set_forward_context(md):
                h = self.module(tokens[live], md.positions, prev[live])
            self.forwards += 1
            t = self.module.compute_logits(h).max(dim=-1).indices
            prev, tokens, states = h, t, live_states
            for st, tok in zip(states, t.tolist()):
                drafts[st.req_id].append(tok)
        return {rid: d[:room[rid]] for rid, d in drafts.items() if room[rid] > 0}
