"""Turns a ``SchedulerOutput`` into tensors, runs the model and samples. Owns the model and its KV cache.

Every model goes through one path: the typed contract in ``models/interface.py`` (forward, compute_logits,
kv_cache_spec, bind_kv_cache), no per-model probing.
"""
from __future__ import annotations

import contextlib
import logging
import time

import msgspec
import torch

from openinfer.config import EngineConfig
from openinfer.distributed.parallel_state import get_dp_group, get_tp_group
from openinfer.forward_context import AttentionMetadata, set_forward_context
from openinfer import envs
from openinfer.layers import dispatch
from openinfer.layers.dispatch import KernelSelection
from openinfer.layers.kv_quant import FP8_DTYPE
from openinfer.layers.linear import prepack_linears, quantize_linears
from openinfer.kv_cache_interface import KVGroupSpec, blocks_for_tokens, check_groups
from openinfer.sampling_params import SamplingParams
from openinfer.step_io import ExpertLoadStats, ModelRunnerOutput, NewRequestData, SampledToken, SchedulerOutput
from openinfer.worker.eplb import ExpertRebalancer
from openinfer.worker.huge_pages import weights_to_huge_pages
from openinfer.worker.proposers import ProposeInputs, make_proposer
from openinfer.worker.rejection_sampler import verify
from openinfer.worker.input_batch import InputBatch, ScheduledRow
from openinfer.worker.loader import load_model
from openinfer.worker.sampler import SamplingRow, sample, top_logprobs, unpack_bitmask

logger = logging.getLogger(__name__)

_PROFILE_ID = "__profile__"


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.dtype = config.model.dtype
        # What the KV stores hold: the model's dtype, or float8_e4m3fn for kv_cache_dtype fp8 (layers/kv_quant.py;
        # DeepSeek-V4 packs its own fp8 layout from it). Models receive it as the dtype of kv_cache_spec /
        # bind_kv_cache; they compute in self.dtype.
        self.kv_dtype = FP8_DTYPE if config.cache.fp8_kv else self.dtype
        self.block_size = config.cache.block_size
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(config.seed)
        self.model = None
        self.proposer = None
        self.load_time_s = 0.0
        self.input_batch: InputBatch | None = None
        self.kv_connector = None  # the KV connector's worker side (disaggregated prefill/decode)
        # OPENINFER_SKIP_UNREAD_ROWS=0 keeps every row of every layer (to measure or bisect the saving; the
        # tokens are the same either way).
        self.skip_unread_rows = envs.SKIP_UNREAD_ROWS
        # How every op runs, decided once in load_model (layers/dispatch.py); the model is loaded and every step
        # runs with it active.
        self.kernels: KernelSelection | None = None

    def load_model(self) -> None:
        t0 = time.perf_counter()
        # Builds (first run on a machine: minutes) or loads the C++ kernels now, at start-up, not inside the first
        # step; a failed build raises KernelBuildError here, naming the compiler's error and the opt-out.
        self.kernels = dispatch.select(self.config.kernel, self.device)
        with dispatch.use(self.kernels):
            self._load_model()
        self.load_time_s = time.perf_counter() - t0

    def _load_model(self) -> None:
        self.model = load_model(self.config.model, self.config.attention_backend, self.device)
        self.model.use_kv_cache_dtype(self.config.cache.kv_cache_dtype)
        if self.config.model.quantization is not None:
            quantize_linears(self.model, self.config.model.quantization)
        prepack_linears(self.model)
        self.rebalancer = ExpertRebalancer(self.model, self.config.parallel.eplb_step_interval)
        self.proposer = make_proposer(self.config, self.device, self.model)
        if self.device.type == "cpu" and envs.HUGE_PAGES:  # the weights are final now (packed, repacked)
            drafter = getattr(self.proposer, "model", None)
            weights_to_huge_pages(self.model, drafter if isinstance(drafter, torch.nn.Module) else None)

    # -- KV cache ----------------------------------------------------------------------------------------
    def kv_cache_spec(self) -> list[KVGroupSpec]:
        """The target's groups, then a drafting model's (they share the block manager)."""
        specs = list(self.model.kv_cache_spec(self.block_size, self.kv_dtype))
        if self.proposer is not None:
            specs += self.proposer.kv_cache_spec(self.block_size, self.kv_dtype)
        check_groups(specs, self.block_size)
        return specs

    def initialize_kv_cache(self, num_blocks: dict[str, int]) -> None:
        """Allocate every group's stores and start a fresh input batch over them. Where replicas step in lockstep,
        one more block per group than the engine knows about: the scratch block of dummy forwards."""
        with dispatch.use(self.kernels):
            self._initialize_kv_cache(num_blocks)

    def _initialize_kv_cache(self, num_blocks: dict[str, int]) -> None:
        specs = self.kv_cache_spec()
        if self.config.parallel.lockstep:
            num_blocks = {name: n + 1 for name, n in num_blocks.items()}
            self._dummy_blocks = {name: n - 1 for name, n in num_blocks.items()}
        self.model.bind_kv_cache(num_blocks, self.block_size, self.kv_dtype, self.device)
        if self.proposer is not None:
            self.proposer.bind_kv_cache(num_blocks, self.block_size, self.kv_dtype, self.device)
        self.input_batch = InputBatch([s.name for s in specs],
                                      {s.name: s.tokens_per_block(self.block_size) for s in specs},
                                      self.block_size, self.device)

    def init_kv_connector(self, engine_id: str, tp_rank: int = 0, rank: int = 0) -> dict:
        from openinfer.distributed.kv_transfer.nixl_worker import NixlConnectorWorker
        from openinfer.worker.kv_tensors import head_split_rows, kv_block_tensors, kv_settings

        specs = self.kv_cache_spec()
        names = [s.name for s in specs]
        self.kv_connector = NixlConnectorWorker(self.config.kv_transfer, engine_id,
                                                kv_settings(self.config, names, self.kv_dtype), tp_rank,
                                                self.config.parallel.tensor_parallel_size, rank)
        return self.kv_connector.register_kv_caches(kv_block_tensors(
            self.model, names, self.proposer, frozenset(s.name for s in specs if s.bytes_per_block == 0)),
            head_split_rows(self.model, self.proposer))

    def init_kv_offload(self, backend: str, locations: list[str], fingerprint: str) -> dict:
        """Start the offloading tier's worker side over the bound cache (every group's stores), on this rank's
        data-parallel replica's location."""
        from openinfer.distributed.kv_transfer.offload_worker import OffloadingConnectorWorker
        from openinfer.worker.kv_tensors import kv_block_tensors

        tier = OffloadingConnectorWorker(backend, locations[get_dp_group().rank_in_group], fingerprint,
                                         get_tp_group())
        # The drafter's groups too: a prefix the tier restores comes back with its drafting KV.
        specs = self.kv_cache_spec()
        info = tier.register_kv_caches(kv_block_tensors(self.model, [s.name for s in specs], self.proposer,
                                                        frozenset(s.name for s in specs if s.bytes_per_block == 0)))
        if self.kv_connector is None:
            self.kv_connector = tier
        else:  # beside prefill/decode disaggregation's connector
            from openinfer.distributed.kv_transfer.multi import MultiConnectorWorker

            self.kv_connector = MultiConnectorWorker(self.kv_connector, tier)
        return info

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward at max_num_batched_tokens against a throwaway cache, so the activation peak is paid (and,
        on CUDA, reserved) before free memory is measured. On a CPU the KV budget holds half of free memory back
        instead of measuring a peak (``Worker.determine_kv_budget``), so the warm-up only has to run every kernel
        once: at max(16, max_num_seqs) tokens, as vLLM's CPU runner does. At the full budget it cost SmolLM2 (8k
        context -> 8192 tokens) ~70 s of one core at every start, most of the README's first command."""
        sc = self.config.scheduler
        n = min(sc.max_num_batched_tokens, self.config.model.max_model_len)
        if self.device.type == "cpu":
            n = min(n, max(16, sc.max_num_seqs))
        specs = self.kv_cache_spec()
        slots = n + sc.num_lookahead_tokens  # as the scheduler allocates: a drafting proposer writes past the tokens
        blocks = {s.name: blocks_for_tokens(slots, s.tokens_per_block(self.block_size)) for s in specs}
        self.initialize_kv_cache(blocks)
        req = NewRequestData(_PROFILE_ID, [0] * n, SamplingParams(temperature=0.0, max_tokens=1),
                             [list(range(blocks[s.name])) for s in specs], 0)
        self.execute_model(SchedulerOutput(new_requests=[req], num_scheduled_tokens={_PROFILE_ID: n}))
        self.model.free_kv_cache()  # the throwaway stores
        if self.proposer is not None:
            self.proposer.free_kv_cache()
        self.input_batch = None
        self.rebalancer.reset()  # the warm-up's routing is no one's load

    # -- one step ----------------------------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput, lockstep: bool = False) -> ModelRunnerOutput:
        """One step; with a KV connector, its loads start first (a request being read is never scheduled, so the
        forward does not wait on them) and what finished is reported with the step's tokens."""
        if self.kv_connector is None:
            with dispatch.use(self.kernels):
                return self._execute_model(sched, lockstep)
        self.kv_connector.start_load_kv(sched.kv_connector_metadata)
        with dispatch.use(self.kernels):
            out = self._execute_model(sched, lockstep)
        self.kv_connector.wait_for_save()
        out.kv_connector_output = self.kv_connector.get_finished()
        return out

    @torch.inference_mode()
    def _execute_model(self, sched: SchedulerOutput, lockstep: bool = False) -> ModelRunnerOutput:
        batch = self.input_batch
        batch.update(sched)
        if sched.empty:
            if not lockstep:
                return ModelRunnerOutput()
            self._pad_proposer(self._dummy_forward(), 0)
            return ModelRunnerOutput(expert_load=self._after_forward())
        inputs = batch.prepare(sched)
        # Rows of hidden needed for logits: the last known token of each sampling sequence (and each of its
        # drafts, with speculative decoding), and every position of prompts that asked for prompt logprobs.
        plain: list[tuple[ScheduledRow, int]] = []  # (row, its logits row)
        spec: list[tuple[ScheduledRow, int]] = []  # (row, its first of k + 1 logits rows)
        logit_rows: list[int] = []
        plp: list[tuple[ScheduledRow, int]] = []  # (row, its first hidden row)
        off = 0
        for r in inputs.rows:
            if r.state.sampling_params.prompt_logprobs is not None and r.start < r.state.num_prompt_tokens:
                plp.append((r, off))
            if r.sample:
                last_known = off + r.num_tokens - 1 - len(r.drafts)
                (spec if r.drafts else plain).append((r, len(logit_rows)))
                logit_rows.extend(range(last_known, last_known + len(r.drafts) + 1))
            off += r.num_tokens
        # The model may skip rows nobody reads: not when a proposer (it reads every row's hidden state) or prompt
        # logprobs (every prompt row's logits) are in play, nor with prefix caching (a later request may resume at
        # any full block, reading the KV of the rows before it, which every row then is), nor for a prompt whose
        # KV another instance reads (a KV connector's producer: that decoder may cache and resume in it).
        if (self.skip_unread_rows and self.proposer is None and not plp and not self.config.cache.enable_prefix_caching
                and not any(_sent_away(r) for r in inputs.rows)):
            inputs.metadata.output_rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        self._place_images(inputs)
        with set_forward_context(inputs.metadata):
            hidden = self.model(inputs.input_ids, inputs.positions)

        out = ModelRunnerOutput()
        proposer_forwards = 0
        if logit_rows:
            logits = self.model.compute_logits(hidden[logit_rows])  # sample() casts to fp32 where it needs
            masks = sched.grammar_bitmask
            if plain:
                self._sample_plain(logits, plain, out, masks)
            for r, first in spec:
                with self._row(out, r):
                    self._verify(logits[first:first + len(r.drafts) + 1], r, out, masks.get(r.state.req_id))
            self._take_driver_tokens(out, [r for r, _ in plain + spec])
        if self.proposer is not None:
            # Also on a step that samples nothing (a prompt's non-final chunks): the drafter catches up over those
            # positions (an MTP layer writes their KV), or its first drafts after the prompt read empty rows.
            out.spec_token_ids = self.proposer.propose(
                ProposeInputs(inputs.rows, [r for r, _ in plain + spec], hidden, batch))
            out.spec_confidence = self.proposer.confidence()
            proposer_forwards = self.proposer.forwards
        if lockstep:
            self._pad_proposer(hidden, proposer_forwards)
        for r, first in plp:
            with self._row(out, r):
                out.prompt_logprobs[r.state.req_id] = self._prompt_logprobs(hidden, r, first)
        out.expert_load = self._after_forward()
        return out

    def _place_images(self, inputs) -> None:
        """The step's image positions: their embeddings from the model's vision tower (each image encoded once,
        when its first position is computed, and dropped after its last), and the mask of image rows."""
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        off = 0
        for r in inputs.rows:
            st = r.state
            known_end = r.start + r.num_tokens - len(r.drafts)
            for i, img in enumerate(st.mm_images):
                lo, hi = max(r.start, img.offset), min(known_end, img.offset + img.length)
                if lo >= hi:
                    continue
                e = st.mm_embeds.get(i)
                if e is None:
                    e = st.mm_embeds[i] = self.model.embed_image(img)
                rows.extend(range(off + lo - r.start, off + hi - r.start))
                embeds.append(e[lo - img.offset:hi - img.offset])
                if hi == img.offset + img.length:
                    del st.mm_embeds[i]
            off += r.num_tokens
        if not rows:
            return
        md = inputs.metadata
        md.mm_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        md.mm_embeds = torch.cat(embeds)
        md.image_rows = torch.zeros(md.num_tokens, dtype=torch.bool, device=self.device)
        md.image_rows[md.mm_rows] = True

    def _sample_plain(self, logits: torch.Tensor, plain: list[tuple[ScheduledRow, int]],
                      out: ModelRunnerOutput, masks: dict[str, bytes]) -> None:
        # The grammar rows of all constrained requests unpacked in one go (one row each here).
        constrained = [i for i, (r, _) in enumerate(plain) if r.state.req_id in masks]
        unpacked = self._masks(b"".join(masks[plain[i][0].state.req_id] for i in constrained), len(constrained),
                               logits.shape[1]) if constrained else None
        row_mask = dict(zip(constrained, range(len(constrained))))
        rows = [SamplingRow(r.state.sampling_params, r.state.prompt_token_ids, r.state.output_token_ids,
                            unpacked[row_mask[i]] if i in row_mask else None) for i, (r, _) in enumerate(plain)]
        # index_select, not logits[list]: list indexing of [S, 32k] logits took ~8 ms on CPU (index_select ~6 us)
        at = torch.tensor([i for _, i in plain], device=logits.device)
        try:
            tokens, raw_lp = sample(logits.index_select(0, at), rows, self.generator)
        except Exception:
            # One row's settings broke the batched sampler: sample each row on its own, so that only the rows
            # that fail alone end (with an error) and their neighbours get their tokens.
            logger.exception("batched sampling failed; sampling the %d rows one by one", len(rows))
            for (r, j), row in zip(plain, rows):
                with self._row(out, r):
                    tok, lp = sample(logits[j:j + 1], [row], self.generator)
                    self._emit(out, r, int(tok[0]), lp, 0)
            return
        for i, ((r, _), tok) in enumerate(zip(plain, tokens.tolist())):
            with self._row(out, r):
                self._emit(out, r, tok, raw_lp, i)

    def _emit(self, out: ModelRunnerOutput, r: ScheduledRow, tok: int, raw_lp: torch.Tensor | None,
              i: int) -> None:
        out.sampled[r.state.req_id] = [self._token(tok, raw_lp, i, r.state.sampling_params.logprobs)]
        self.input_batch.append_sampled(r, [tok])

    @contextlib.contextmanager
    def _row(self, out: ModelRunnerOutput, r: ScheduledRow):
        """Work that belongs to one request: if it raises, that request is reported failed (and ends with an
        error in the scheduler) while the rest of the step goes on."""
        try:
            yield
        except Exception as e:
            logger.exception("request %s: its row failed this step", r.state.req_id)
            out.sampled.pop(r.state.req_id, None)
            out.failed[r.state.req_id] = f"{type(e).__name__}: {e}"

    def _verify(self, logits: torch.Tensor, r: ScheduledRow, out: ModelRunnerOutput, mask: bytes | None) -> None:
        """The drafts of one request against the target's k + 1 distributions (rejection_sampler.py); with
        structured outputs each distribution is masked by the grammar's state after the drafts before it, so a
        draft the grammar forbids is never accepted and every emitted token is one the grammar allows."""
        st = r.state
        tokens, raw_lp = verify(logits, r.drafts, st.sampling_params, st.prompt_token_ids, st.output_token_ids,
                                self.generator, _draft_probs(r),
                                allowed_masks=self._masks(mask, len(r.drafts) + 1, logits.shape[1]))
        out.sampled[st.req_id] = [self._token(t, raw_lp, j, st.sampling_params.logprobs) for j, t in enumerate(tokens)]
        self.input_batch.append_sampled(r, tokens)

    def _take_driver_tokens(self, out: ModelRunnerOutput, rows: list[ScheduledRow]) -> None:
        """Tensor parallel: the replica's first rank's sampled and accepted tokens become every rank's (the engine
        reads that rank's). Every rank samples from the same all-gathered logits with the same seeded generator,
        so they agree already; this makes a disagreement (a row that failed on one rank only, a device whose
        sampling is not bitwise reproducible) impossible to turn into ranks whose requests differ in length, whose
        next forwards would then feed different tokens to the same sharded layers."""
        tp = get_tp_group()
        if tp.world_size == 1:
            return
        mine = {r.state.req_id: [t.token_id for t in out.sampled[r.state.req_id]] if r.state.req_id in out.sampled
                else None for r in rows}
        driver = msgspec.msgpack.decode(tp.broadcast_bytes(msgspec.msgpack.encode(mine)))
        if tp.is_first_rank or driver == mine:
            return
        for r in rows:
            st, got, want = r.state, mine[r.state.req_id], driver[r.state.req_id]
            if got == want:
                continue
            keep = len(st.token_ids) - len(got or [])
            del st.token_ids[keep:]
            del st.output_token_ids[keep - st.num_prompt_tokens:]
            if want is None:
                out.sampled.pop(st.req_id, None)
                out.failed.setdefault(st.req_id, "failed on the replica's first rank")
            else:
                out.failed.pop(st.req_id, None)
                out.sampled[st.req_id] = [SampledToken(t) for t in want]
                self.input_batch.append_sampled(r, want)

    def _masks(self, data: bytes | None, num_rows: int, vocab_size: int) -> torch.Tensor | None:
        return None if data is None else unpack_bitmask(data, num_rows, vocab_size, self.device)

    @staticmethod
    def _token(tok: int, raw_lp: torch.Tensor | None, row: int, num_logprobs: int | None) -> SampledToken:
        if num_logprobs is None:
            return SampledToken(tok)
        tl = top_logprobs(raw_lp, row, tok, num_logprobs)
        return SampledToken(tok, tl[tok], tl)

    def _after_forward(self) -> ExpertLoadStats | None:
        """Expert load balancing counts forwards (every rank runs the same ones) and rebalances between them."""
        return self.rebalancer.stats if self.rebalancer.after_step() else None

    def _pad_proposer(self, hidden: torch.Tensor, done: int) -> None:
        """Under data-parallel lockstep: the proposer's remaining forwards of the step as dummies (proposers/
        __init__.py, ``lockstep_forwards``), so every replica's ranks meet the same collectives."""
        if self.proposer is not None:
            for _ in range(self.proposer.lockstep_forwards - done):
                self.proposer.dummy_forward(hidden, self._dummy_blocks, self.input_batch)

    def _dummy_forward(self) -> torch.Tensor:
        """One token through the model on the scratch block, nothing sampled: this replica has no work, but its
        ranks must take part in the collectives (expert-parallel all-to-all) another replica's step runs."""
        names = self.input_batch.group_names
        md = AttentionMetadata.build([1], [1], {n: [[self._dummy_blocks[n]]] for n in names},
                                     self.input_batch.tokens_per_block, self.block_size, self.device)
        md.is_dummy = True
        with set_forward_context(md):
            return self.model(torch.zeros(1, dtype=torch.long, device=self.device), md.positions)

    def _prompt_logprobs(self, hidden: torch.Tensor, r: ScheduledRow, first: int) -> list[dict[int, float]]:
        """Logprob of prompt token p+1 given tokens <= p, for each prompt position p in this chunk."""
        st = r.state
        k = st.sampling_params.prompt_logprobs
        count = min(r.num_tokens, st.num_prompt_tokens - r.start)
        positions = [p for p in range(r.start, r.start + count) if p + 1 < st.num_prompt_tokens]
        if not positions:
            return []
        rows = [first + (p - r.start) for p in positions]
        lp = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
        return [top_logprobs(lp, i, st.prompt_token_ids[p + 1], k) for i, p in enumerate(positions)]


def _draft_probs(r: ScheduledRow) -> torch.Tensor | None:
    """The distributions the row's drafts were drawn from (None: drawn deterministically, one-hot). The scheduler
    verifies a prefix of what was proposed (trimmed by budget, context, grammar or confidence)."""
    if r.state.draft_probs is None or r.state.sampling_params.greedy:
        return None
    proposed, probs = r.state.draft_probs
    if proposed[:len(r.drafts)] != r.drafts:
        raise RuntimeError(f"request {r.state.req_id}: verifying drafts {r.drafts} that are not a prefix of the "
                           f"sampled proposal {proposed}")
    return probs[:len(r.drafts)]


def _sent_away(row: ScheduledRow) -> bool:
    params = row.state.sampling_params.kv_transfer_params
    return bool(params and params.get("do_remote_decode"))
