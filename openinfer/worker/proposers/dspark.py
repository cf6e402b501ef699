"""DSpark proposer: DeepSeek-V4.1's draft blocks (models/deepseek_v41/dspark.py) draft k tokens per request in one
block forward, as DeepInfer's DFlash does. Selected by ``method: "mtp"`` on a V4.1 checkpoint (DeepInfer's MTP
module *is* DSpark there; models/registry.py ``uses_dspark``).

What must survive steps is, per token, every draft block's context key (projected from the target layers'
attention inputs, roped at the token's position): the proposer pages them in its own sliding KV group
``dspark.window`` (read W = sliding_window tokens back, as DeepInfer keeps them in the SWA cache), so prefix hits,
chunked prefill and preemption treat them like the target's window rows. Each step, after the target sampled:

1. page: the target ran with ``capture_dspark_features``; the keys of every token it computed this step go into
   the store at the token's slot. Rejected drafts' positions get keys too; they are recomputed (and overwritten)
   by the target's next forward before any draft reads them, exactly like the target's own KV.
2. draft: a sampling request with L known tokens has target features up to a = L - 2 (the newest token, golden,
   is not computed yet). Its block reads the keys of a - W + 1 .. a and runs at positions a + 1 .. a + k on
   [golden, noise x (k - 1)]; position i drafts the token at a + 2 + i. The block size is k (DeepInfer sizes its
   draft block by the number of speculative tokens), so k may not exceed the checkpoint's dspark_block_size.

Drafts carry the Markov correction. A greedy request's are the argmax (verification treats them as one-hot); a
sampling request's are drawn from its own sampling distribution (temperature, top-k / top-p / min-p) of each
position's corrected logits, as DeepInfer's ``sample_drafts`` runs the request's sampling per draft position, and
those distributions q go with the drafts (``CachedRequestState.draft_probs``) to the rejection sampler, which
accepts with min(1, p / q) and resamples from max(p - q, 0): the output stays the target's distribution and
acceptance is DeepInfer's. The confidence head's predicted acceptance is reported
(``SpecDecodeStats.confidence_per_pos`` beside the measured ``accepted_per_pos``) and, with
``speculative_config.confidence_token_cost``, decides how many of the drafts the next step verifies
(engine/confidence_schedule.py).
"""
from __future__ import annotations

import torch

from openinfer.config import EngineConfig
from openinfer.forward_context import AttentionMetadata, set_forward_context
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.models.interface import DSparkTarget
from openinfer.worker.input_batch import CachedRequestState
from openinfer.worker.proposers import ProposeInputs
from openinfer.worker.proposers.drafting import DraftingModel
from openinfer.worker.sampler import SamplingRow, sampling_probs, seeded_generator

WINDOW_GROUP = "window"


class ContextKeyStore:
    """The paged per-token context keys [num_blocks, block_size, draft blocks, head_dim], as a KV-cache owner."""

    def __init__(self, num_draft_blocks: int, head_dim: int, window: int) -> None:
        self.num_draft_blocks, self.head_dim, self.window = num_draft_blocks, head_dim, window
        self.keys: torch.Tensor | None = None

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
        elem = torch.empty((), dtype=dtype).element_size()
        # a draft at position L - 1 reads keys from L - 1 - W on: lookback W
        return [KVGroupSpec(WINDOW_GROUP, block_size * self.num_draft_blocks * self.head_dim * elem,
                            lookback_tokens=self.window)]

    def bind_kv_cache(self, num_blocks: dict[str, int], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        self.keys = torch.zeros(num_blocks[WINDOW_GROUP], block_size, self.num_draft_blocks, self.head_dim,
                                dtype=dtype, device=device)

    def free_kv_cache(self) -> None:
        self.keys = None

    def flat(self) -> torch.Tensor:
        return self.keys.view(-1, self.num_draft_blocks, self.head_dim)


class DSparkProposer(DraftingModel):
    prefix = "dspark."

    def __init__(self, config: EngineConfig, device: torch.device, target: DSparkTarget) -> None:
        k = config.speculative.num_speculative_tokens
        shape = target.dspark_shape()
        if shape.draft_blocks == 0:
            raise ValueError(f"speculative_config.method='mtp': {config.model.path} has no DSpark draft blocks "
                             "(mtp.* tensors); the checkpoint declares num_nextn_predict_layers="
                             f"{shape.declared_blocks}")
        if k > shape.max_draft_tokens:
            raise ValueError(f"speculative_config.num_speculative_tokens={k} exceeds the checkpoint's "
                             f"dspark_block_size={shape.max_draft_tokens} (the DSpark block was trained for at most "
                             "that many draft positions)")
        self.target = target
        self.window = shape.window
        target.capture_dspark_features(True)
        store = ContextKeyStore(shape.draft_blocks, shape.key_dim, self.window)
        super().__init__(store, k, config.model.max_model_len, config.cache.block_size, device)
        self.last_confidence: dict[str, list[float]] = {}
        # One block forward per step drafts every request: each draft block's MoE meets the other replicas once.
        self.lockstep_forwards = 1

    def dummy_forward(self, hidden: torch.Tensor, scratch: dict[str, int], batch) -> None:
        """The block forward of one request with no context (its one context key is padding) and token 0 as its
        golden token, so this replica's ranks join the draft blocks' expert-parallel all-to-alls. Nothing is read
        from or written to the key store, the drafts are dropped, and the forward context marks it dummy (no
        expert load counted)."""
        shape = self.target.dspark_shape()
        keys = torch.zeros(1, 1, shape.draft_blocks, shape.key_dim, dtype=self.module.keys.dtype,
                           device=self.device)
        ctx_pos = torch.full((1, 1), -1, dtype=torch.long, device=self.device)
        md = AttentionMetadata.build([1], [1], {}, {}, self.block_size, self.device)
        md.is_dummy = True
        with set_forward_context(md):
            self.target.propose_over_keys(keys, ctx_pos, torch.zeros(1, dtype=torch.long, device=self.device),
                                          block_size=self.k)

    def propose(self, step: ProposeInputs) -> dict[str, list[int]]:
        self.forwards = 0
        batch = step.batch
        (g,) = self.group_rows(batch).values()
        tpb = batch.tokens_per_block[self.prefix + WINDOW_GROUP]
        store = self.module.flat()

        def slots(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            # table: the request's incremental int64 mirror of its block ids (not a conversion of the whole list,
            # which grew with context: two per request and step)
            return table.to(self.device)[positions // tpb] * tpb + positions % tpb

        # 1) page the keys of every token the target computed this step (rows in step order, as the features)
        positions, slot_rows = [], []
        for r in step.rows:
            pos = torch.arange(r.start, r.start + r.num_tokens, device=self.device)
            positions.append(pos)
            slot_rows.append(slots(r.state.block_table(g), pos))
        positions = torch.cat(positions)
        features = self.target.dspark_features()
        assert features is not None and features.shape[0] == positions.shape[0]
        store[torch.cat(slot_rows)] = self.target.dspark_context_keys(features, positions).to(store.dtype)

        # 2) one draft block per sampling request with room for another token
        states = [r.state for r in step.sampled if len(r.state.token_ids) < self.max_model_len]
        if not states:
            return {}
        accepted = torch.tensor([len(st.token_ids) - 2 for st in states], device=self.device)  # a = L - 2
        ctx_pos = self.target.dspark_context_positions(accepted, self.window, self.k)
        keys = torch.stack([store[slots(st.block_table(g), p.clamp(min=0))] for st, p in zip(states, ctx_pos)])
        golden = torch.tensor([st.token_ids[-1] for st in states], dtype=torch.long, device=self.device)
        draw = DraftDraw(states)
        tokens, confidence = self.target.propose_over_keys(keys, ctx_pos, golden, block_size=self.k, draw=draw)
        self.forwards = 1
        self.last_confidence = {st.req_id: c for st, c in zip(states, confidence.tolist())}
        proposals = {st.req_id: t for st, t in zip(states, tokens.tolist())}
        draw.hand_over(proposals)
        return proposals

    def kv_stores(self) -> list[tuple[str, torch.Tensor | None]]:
        return [(self.prefix + WINDOW_GROUP, self.module.keys)]

    def confidence(self) -> dict[str, list[float]]:
        return self.last_confidence


class DraftDraw:
    """Picks each draft position's tokens: argmax for greedy requests; for sampling ones a draw from the request's
    sampling distribution, kept (per request, [k, V]) for verification. A seeded request draws from its own
    generator per output position (a stream apart from the verifier's), so its drafts - and so its output -
    repeat."""

    STREAM = 2  # seeded_generator streams: 0 the plain / residual draws, 1 the acceptance coins

    def __init__(self, states: list[CachedRequestState]) -> None:
        self.states = states
        self.rows = [i for i, st in enumerate(states) if not st.sampling_params.greedy]
        self.probs: list[torch.Tensor] = []  # per draft position: [len(rows), V]

    def __call__(self, logits: torch.Tensor, i: int) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        if not self.rows:
            return tokens
        idx = torch.tensor(self.rows, device=logits.device)
        sampled = [self.states[r] for r in self.rows]
        q = sampling_probs(logits.index_select(0, idx).float(),
                           [SamplingRow(st.sampling_params, st.prompt_token_ids, st.output_token_ids)
                            for st in sampled])
        race = torch.empty_like(q)
        for j, st in enumerate(sampled):
            seed = st.sampling_params.seed
            g = None if seed is None else seeded_generator(seed, len(st.output_token_ids) + i, q.device, self.STREAM)
            race[j].exponential_(generator=g)
        tokens[idx] = (q / race).argmax(dim=-1)  # the exponential race: a draw from q
        self.probs.append(q)
        return tokens

    def hand_over(self, proposals: dict[str, list[int]]) -> None:
        """Each request's drafts with their distributions (None for greedy ones: one-hot)."""
        for st in self.states:
            st.draft_probs = None
        if not self.rows:
            return
        probs = torch.stack(self.probs, dim=1)  # [rows, k, V]
        for j, r in enumerate(self.rows):
            st = self.states[r]
            st.draft_probs = (proposals[st.req_id], probs[j])
