"""Per-step metadata that reaches attention layers without threading it through every ``forward()``.

The model runner builds one ``AttentionMetadata`` per step and sets it around the forward pass. Sequences are
ordered decodes first (one query token each) so the decode part is one contiguous, batchable slice; sequence i
is row i of every KV group's block table. A layer reads the tables of the group its stores live in
(``md.group(name)``, the names the model declared in ``kv_cache_spec``); everything per group is derived lazily,
so a step only pays for what its layers read.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    """One sequence computing more than one token this step (a prompt chunk, or a recompute)."""

    query_start: int  # offset in the flat token batch
    query_len: int
    context_len: int  # tokens in the KV cache after this step, including these queries
    row: int  # the sequence's row in every group's block tables


class KVGroupTables:
    """One KV group's block tables for the step: ``block_tables`` [S, max_blocks] int64, row i for sequence i,
    padded with block 0 (never read past a sequence's length)."""

    def __init__(self, md: AttentionMetadata, block_tables: torch.Tensor, tokens_per_block: int) -> None:
        self._md = md
        self.block_tables = block_tables
        self.tokens_per_block = tokens_per_block
        self._slot_mapping: torch.Tensor | None = None
        self._decode_tables: torch.Tensor | None = None

    @property
    def slot_mapping(self) -> torch.Tensor:
        """[T] int64: flat slot (block * tokens_per_block + offset) of each of the step's tokens in this group."""
        if self._slot_mapping is None:
            md, r = self._md, self.tokens_per_block
            pos = md.positions
            self._slot_mapping = self.block_tables[md.token_rows, pos // r] * r + pos % r
        return self._slot_mapping

    @property
    def decode_block_tables(self) -> torch.Tensor | None:
        """[num_decodes, blocks of the longest decode], contiguous (what decode kernels take); None without
        decodes."""
        md = self._md
        if not md.num_decodes:
            return None
        if self._decode_tables is None:
            width = -(-int(md.max_decode_len) // self.tokens_per_block)
            self._decode_tables = self.block_tables[:md.num_decodes, :width].contiguous()
        return self._decode_tables

    def table(self, span: PrefillSpan) -> torch.Tensor:
        """A prefill sequence's table, exactly as long as its context."""
        return self.block_tables[span.row, :-(-span.context_len // self.tokens_per_block)]


@dataclass
class AttentionMetadata:
    num_tokens: int
    block_size: int
    positions: torch.Tensor  # [T] int64
    token_rows: torch.Tensor  # [T] int64: the sequence (table row) of each token
    num_decodes: int  # the first num_decodes tokens (and rows) are single-token sequences
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64: context after this step
    prefills: list[PrefillSpan]
    groups: dict[str, KVGroupTables] = field(default_factory=dict)
    max_decode_len: int = 0
    # A forward with nothing scheduled, run only to take part in collectives (lockstep replicas): nothing it
    # computes counts (e.g. toward expert load).
    is_dummy: bool = False
    # [R] int64: the only rows of the model's output this step reads (None: all of them). A model may leave the
    # other rows unset and skip work only they need (DeepSeek-V4.1's YOCO consumer layers do); the KV that
    # the next steps of the same requests read must stay complete. Set by the model runner only when nothing else
    # reads the hidden states and no later request can resume from this step's blocks (prefix caching off).
    output_rows: torch.Tensor | None = None
    # Image input (multimodal models): the step's rows whose embeddings come from the vision tower instead of the
    # token embedding ([M] int64 into the flat batch) and those embeddings ([M, hidden]); ``image_rows`` [T] bool
    # marks every row of an image's positions (its markers too: DeepSeek-V4.1 routes them with bias_vl).
    mm_rows: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None
    image_rows: torch.Tensor | None = None
    _decode_bias: dict = field(default_factory=dict, repr=False)
    _decode_mask: torch.Tensor | None = field(default=None, repr=False)

    def group(self, name: str) -> KVGroupTables:
        try:
            return self.groups[name]
        except KeyError:
            raise KeyError(f"no KV group {name!r} in this step's metadata (groups: {sorted(self.groups)}); a layer's "
                           f"kv_group must be one the model declares in kv_cache_spec") from None

    @property
    def decode_mask(self) -> torch.Tensor | None:
        """[num_decodes, 1, 1, max_decode_len padded to blocks] bool: which key slots each decode may read (the
        gather + SDPA fallback; decode kernels read the lengths instead)."""
        if not self.num_decodes:
            return None
        if self._decode_mask is None:
            width = -(-self.max_decode_len // self.block_size) * self.block_size
            cols = torch.arange(width, device=self.positions.device)
            self._decode_mask = (cols[None, :] < self.decode_seq_lens[:, None])[:, None, None, :]
        return self._decode_mask

    def decode_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``decode_mask`` as an additive float mask, built once per step and dtype: SDPA would otherwise convert
        the bool mask again in every layer."""
        mask = self.decode_mask
        if mask is None:
            return None
        bias = self._decode_bias.get(dtype)
        if bias is None:
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            bias.masked_fill_(~mask, float("-inf"))
            self._decode_bias[dtype] = bias
        return bias

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: dict[str, list[list[int]] | list[torch.Tensor]],
              tokens_per_block: dict[str, int], block_size: int, device: torch.device) -> AttentionMetadata:
        """Metadata for sequences in step order (single-token ones first): sequence i computes ``query_lens[i]``
        tokens ending at ``context_lens[i]``; ``block_tables[g][i]`` is its table in group g (a list of block
        ids or an int64 tensor of them)."""
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        if any(n == 1 for n in query_lens[num_decodes:]):
            raise ValueError("single-token sequences must come first in a step")
        positions: list[int] = []
        for n, ctx in zip(query_lens, context_lens):
            positions.extend(range(ctx - n, ctx))
        counts = torch.tensor(query_lens, dtype=torch.long, device=device)
        prefills, off = [], num_decodes
        for i in range(num_decodes, len(query_lens)):
            prefills.append(PrefillSpan(off, query_lens[i], context_lens[i], i))
            off += query_lens[i]
        md = cls(
            num_tokens=len(positions), block_size=block_size,
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            token_rows=torch.repeat_interleave(torch.arange(len(query_lens), device=device), counts),
            num_decodes=num_decodes,
            decode_seq_lens=torch.tensor(context_lens[:num_decodes], dtype=torch.long, device=device)
            if num_decodes else None,
            prefills=prefills, max_decode_len=max(context_lens[:num_decodes], default=0))
        for name, rows in block_tables.items():
            md.groups[name] = KVGroupTables(md, padded_block_table(rows, device), tokens_per_block[name])
        return md


def padded_block_table(rows: list[list[int]] | list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[S, longest row (at least 1)] int64, padded with block 0. Rows as int64 tensors (the worker's incremental
    mirrors, ``input_batch.BlockIdMirror``) are copied; rows as lists are converted id by id."""
    width = max(1, max((len(r) for r in rows), default=0))
    if rows and all(isinstance(r, torch.Tensor) for r in rows):
        table = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
        if table.shape[1] < width:  # every row empty
            table = torch.zeros(len(rows), width, dtype=torch.long)
        return table.to(device=device, dtype=torch.long)
    padded = [(r if isinstance(r, list) else r.tolist()) + [0] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.long, device=device).view(-1, width)


_CURRENT: AttentionMetadata | None = None


def peek_forward_context() -> AttentionMetadata | None:
    """The current step's metadata, or None outside a model-runner step."""
    return _CURRENT


def get_forward_context() -> AttentionMetadata:
    if _CURRENT is None:
        raise RuntimeError("attention called outside a model-runner step (no forward context set)")
    return _CURRENT


@contextlib.contextmanager
def set_forward_context(md: AttentionMetadata):
    global _CURRENT
    prev, _CURRENT = _CURRENT, md
    try:
        yield
    finally:
        _CURRENT = prev
