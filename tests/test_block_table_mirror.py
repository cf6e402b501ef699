"""The worker's incremental block-table mirrors (``input_batch.BlockIdMirror``) against converting the lists: the
step's padded tables must be the very tensors ``torch.tensor`` of the padded lists gives, as the lists grow."""
from __future__ import annotations

import random

import torch

from openinfer.forward_context import AttentionMetadata, padded_block_table
from openinfer.sampling_params import SamplingParams
from openinfer.worker.input_batch import BlockIdMirror, CachedRequestState


def _reference(rows: list[list[int]]) -> torch.Tensor:
    width = max(1, max((len(r) for r in rows), default=0))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long).view(-1, width)


def test_mirror_follows_the_list_as_it_grows() -> None:
    rng = random.Random(0)
    ids: list[int] = []
    mirror = BlockIdMirror(ids)
    assert mirror.tensor().shape == (0,)
    for n in (1, 0, 15, 1, 3, 40, 200, 0, 1000):  # crosses the initial capacity (16) and several doublings
        ids.extend(rng.randrange(1 << 40) for _ in range(n))
        assert torch.equal(mirror.tensor(), torch.tensor(ids, dtype=torch.long))
    del ids[5:]  # not append-only any more: the mirror starts again rather than serving stale ids
    ids.append(7)
    assert torch.equal(mirror.tensor(), torch.tensor(ids, dtype=torch.long))


def test_request_state_mirror_follows_a_replaced_list() -> None:
    st = CachedRequestState("r", [1, 2], SamplingParams(), [[3, 4], [5]], 0, [1, 2], [])
    assert torch.equal(st.block_table(0), torch.tensor([3, 4]))
    st.block_ids[0].extend([9, 10])
    assert torch.equal(st.block_table(0), torch.tensor([3, 4, 9, 10]))
    st.block_ids[1] = [6, 7, 8]  # a new list object: a new mirror
    assert torch.equal(st.block_table(1), torch.tensor([6, 7, 8]))


def test_padded_tables_from_mirrors_equal_the_lists() -> None:
    rng = random.Random(1)
    for rows in ([], [[]], [[], []], [[5]], [[1, 2, 3], [], [4]],
                 [[rng.randrange(1 << 20) for _ in range(rng.randrange(0, 300))] for _ in range(9)]):
        want = _reference(rows)
        tensors = [torch.tensor(r, dtype=torch.long) for r in rows]
        for got in (padded_block_table(rows, torch.device("cpu")), padded_block_table(tensors, torch.device("cpu"))):
            assert got.dtype == torch.long and torch.equal(got, want), (rows, got, want)
    # through the metadata: slot mappings of a mixed decode / prefill step agree
    rows = [[7, 3], [2, 9, 4], [8]]
    md_list = AttentionMetadata.build([1, 1, 5], [20, 33, 7], {"g": rows}, {"g": 16}, 16, torch.device("cpu"))
    md_tens = AttentionMetadata.build([1, 1, 5], [20, 33, 7], {"g": [torch.tensor(r) for r in rows]}, {"g": 16}, 16,
                                      torch.device("cpu"))
    assert torch.equal(md_list.group("g").block_tables, md_tens.group("g").block_tables)
    assert torch.equal(md_list.group("g").slot_mapping, md_tens.group("g").slot_mapping)
