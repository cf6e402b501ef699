"""Turns a ``SchedulerOutput`` into tensors, runs the model and samples. Owns the model and its KV cache."""
from __future__ import annotations

import logging
import time

import torch

from openinfer.config import EngineConfig
from openinfer.engine.kv_groups import COARSE, FULL, WINDOW, KVGroupSpec, bytes_per_token, group
from openinfer.engine.scheduler import RunnerOutput, SampledToken, ScheduledSeq, SchedulerOutput
from openinfer.executor.forward_context import AttentionMetadata, PrefillSpan, set_forward_context
from openinfer.executor.kv_sizing import plan_kv_blocks
from openinfer.executor.loader import load_model
from openinfer.executor.sampler import SamplingRow, sample, top_logprobs
from openinfer.layers import cpu_ops
from openinfer.layers.attention import Attention
from openinfer.layers.linear import prepack_linears
from openinfer.utils.cpu_malloc import tune_malloc

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.model.device
        self.dtype = config.model.dtype
        self.block_size = config.cache.block_size
        if self.device.type == "cpu":
            tune_malloc()  # before the model's first activations (utils/cpu_malloc.py says why)
        torch.manual_seed(config.seed)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        t0 = time.perf_counter()
        self.model = load_model(config.model)
        prepack_linears(self.model)
        backend = "reference" if config.attention_backend == "reference" else "sdpa"
        for layer in self.attention_layers():
            layer.backend = backend
        if (self.device.type == "cpu" and backend == "sdpa"
                and any(isinstance(a, Attention) for a in self.attention_layers())):
            # Build (first run on a machine: ~7 s) or load the C++ decode kernel now, at start-up, rather than
            # inside the first decode step where it would land in the first request's latency. Only models
            # whose layers use it (paged Attention; not MLA or DeepSeek-V4's own attention) pay for it.
            cpu_ops.get_ops()
        self.load_time_s = time.perf_counter() - t0
        self.num_blocks: dict[str, int] = {}

    # -- KV cache --------------------------------------------------------------------------------
    def attention_layers(self):
        return self.model.attention_layers()

    def kv_groups(self) -> list[KVGroupSpec]:
        return kv_groups_of(self.model, self.block_size, self.dtype)

    def kv_bytes_per_token(self) -> int:
        """What every token holds for its sequence's whole life (kv_groups.bytes_per_token)."""
        return bytes_per_token(self.kv_groups(), self.block_size)

    def init_kv_cache(self) -> dict[str, int]:
        """Warm up at the largest step, then size and allocate the cache from what is left. Returns the
        number of blocks per KV group."""
        self.profile_run()
        c = self.config
        self.num_blocks = plan_kv_blocks(c.cache, c.scheduler, c.model.max_model_len, self.device,
                                         self.kv_groups())
        self._allocate(self.num_blocks)
        return self.num_blocks

    def _allocate(self, num_blocks: dict[str, int]) -> None:
        if hasattr(self.model, "kv_cache_spec"):
            self.model.allocate_kv_cache(num_blocks, self.block_size, self.dtype, self.device)
            return
        custom = getattr(self.model, "allocate_kv_cache", None)
        if custom is not None:
            custom(num_blocks[FULL], self.block_size, self.dtype, self.device)
            return
        for a in self.attention_layers():
            shape = (num_blocks[FULL], self.block_size, a.num_kv_heads, a.head_dim)
            a.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            a.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward at max_num_batched_tokens against a throwaway cache, so the activation peak is
        paid (and, on CUDA, reserved) before free memory is measured."""
        sc = self.config.scheduler
        n = min(sc.max_num_batched_tokens, self.config.model.max_model_len)
        blocks = -(-n // self.block_size)
        groups = self.kv_groups()
        coarse = group(groups, COARSE)
        num_coarse = -(-n // coarse.block_tokens) if coarse is not None else 0
        self._allocate({g.name: num_coarse if g.name == COARSE else blocks for g in groups})
        window_ids = list(range(blocks)) if group(groups, WINDOW) is not None else None
        coarse_ids = list(range(num_coarse)) if coarse is not None else None
        seq = ScheduledSeq("__profile__", [0] * n, 0, list(range(blocks)), True,
                           _greedy_params(), [0] * n, [], n, window_ids, coarse_ids)
        self.execute(SchedulerOutput([seq], n))
        for a in self.attention_layers():
            a.k_cache = a.v_cache = None
        if hasattr(self.model, "free_kv_cache"):
            self.model.free_kv_cache()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    # -- one step --------------------------------------------------------------------------------
    def _metadata(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        dev = self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in seqs:
            ids.extend(s.token_ids)
            start = s.start_pos
            positions = range(start, start + len(s.token_ids))
            pos.extend(positions)
            bt = s.block_ids
            slots.extend(bt[p // bs] * bs + p % bs for p in positions)
        window = bool(seqs) and seqs[0].window_block_ids is not None
        wslots: list[int] = []
        if window:  # hybrid models: token-level stores live in the window group's blocks
            for s in seqs:
                wt = s.window_block_ids
                wslots.extend(wt[p // bs] * bs + p % bs for p in range(s.start_pos, s.start_pos + len(s.token_ids)))
        num_decodes = 0
        while num_decodes < len(seqs) and len(seqs[num_decodes].token_ids) == 1:
            num_decodes += 1
        dbt = dlens = dmask = wdbt = None
        if num_decodes:
            dec = seqs[:num_decodes]
            max_blocks = max(len(s.block_ids) for s in dec)
            table = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in dec]
            dbt = torch.tensor(table, dtype=torch.long, device=dev)
            if window:
                wdbt = torch.tensor([s.window_block_ids + [0] * (max_blocks - len(s.window_block_ids)) for s in dec],
                                    dtype=torch.long, device=dev)
            lens = [s.start_pos + 1 for s in dec]
            dlens = torch.tensor(lens, dtype=torch.long, device=dev)
            dmask = (torch.arange(max_blocks * bs, device=dev)[None, :] < dlens[:, None])[:, None, None, :]
        prefills = []
        off = sum(len(s.token_ids) for s in seqs[:num_decodes])
        for s in seqs[num_decodes:]:
            n = len(s.token_ids)
            wbt = torch.tensor(s.window_block_ids, dtype=torch.long, device=dev) if window else None
            prefills.append(PrefillSpan(off, n, s.start_pos + n,
                                        torch.tensor(s.block_ids, dtype=torch.long, device=dev), wbt))
            off += n
        md = AttentionMetadata(
            num_tokens=len(ids), block_size=bs,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=num_decodes, decode_block_tables=dbt, decode_seq_lens=dlens,
            decode_mask=dmask, prefills=prefills,
            window_slot_mapping=torch.tensor(wslots, dtype=torch.long, device=dev) if window else None,
            window_decode_block_tables=wdbt,
            coarse_block_tables=_padded([s.coarse_block_ids for s in seqs], dev)
            if seqs and seqs[0].coarse_block_ids is not None else None,
        )
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                md)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        # Decodes first: the attention backend batches that contiguous slice.
        seqs = sorted(sched.seqs, key=lambda s: len(s.token_ids) != 1)
        input_ids, positions, md = self._metadata(seqs)
        with set_forward_context(md):
            hidden = self.model(input_ids, positions)

        # Rows of hidden needed for logits: the last token of each sampling sequence, and every position of
        # prompts that asked for prompt logprobs.
        sample_rows: list[int] = []
        sample_seqs: list[ScheduledSeq] = []
        plp: list[tuple[ScheduledSeq, int, int]] = []  # (seq, first hidden row, count)
        off = 0
        for s in seqs:
            n = len(s.token_ids)
            if s.sampling_params.prompt_logprobs is not None and s.start_pos < s.num_prompt_tokens:
                plp.append((s, off, min(n, s.num_prompt_tokens - s.start_pos)))
            if s.sample:
                sample_rows.append(off + n - 1)
                sample_seqs.append(s)
            off += n
        out = RunnerOutput()
        if sample_rows:
            logits = self.model.compute_logits(hidden[sample_rows])  # sample() casts to fp32 where it needs
            rows = [SamplingRow(s.sampling_params, s.prompt_token_ids, s.output_token_ids) for s in sample_seqs]
            tokens, raw_lp = sample(logits, rows, self.generator)
            tokens_list = tokens.tolist()
            for i, s in enumerate(sample_seqs):
                tok = tokens_list[i]
                k = s.sampling_params.logprobs
                if k is None:
                    out.sampled[s.request_id] = SampledToken(tok)
                else:
                    tl = top_logprobs(raw_lp, i, tok, k)
                    out.sampled[s.request_id] = SampledToken(tok, tl[tok], tl)
        for s, first, count in plp:
            out.prompt_logprobs[s.request_id] = self._prompt_logprobs(hidden, s, first, count)
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, s: ScheduledSeq, first: int, count: int):
        """Logprob of prompt token p+1 given tokens <= p, for each prompt position p in this chunk."""
        k = s.sampling_params.prompt_logprobs
        result = []
        positions = [p for p in range(s.start_pos, s.start_pos + count) if p + 1 < s.num_prompt_tokens]
        if not positions:
            return result
        rows = [first + (p - s.start_pos) for p in positions]
        lp = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
        for i, p in enumerate(positions):
            result.append(top_logprobs(lp, i, s.prompt_token_ids[p + 1], k))
        return result


def kv_groups_of(model, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
    """A model's KV groups (kv_groups.py); works on a model built on the meta device. Models without a
    ``kv_cache_spec`` hook have one full group: their ``kv_bytes_per_token``, else K and V per attention layer."""
    spec = getattr(model, "kv_cache_spec", None)
    if spec is not None:
        return list(spec(block_size))
    custom = getattr(model, "kv_bytes_per_token", None)
    if custom is not None:
        return [KVGroupSpec(FULL, int(custom()) * block_size)]
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = sum(2 * a.num_kv_heads * a.head_dim * elem for a in model.attention_layers())
    return [KVGroupSpec(FULL, per_token * block_size)]


def _padded(tables: list[list[int]], dev: torch.device) -> torch.Tensor:
    width = max(1, max(len(t) for t in tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev)


def _greedy_params():
    from openinfer.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1)
