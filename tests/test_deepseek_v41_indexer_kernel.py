"""V4.1's indexer kernel (cpu_kernels/indexer_select.cpp) against the torch code it replaces in Attention._choose:
Indexer.score over keys gathered through StepIndex.entry_slots, then select_topk / candidate_blocks /
candidate_mask. Odd head dims and counts, C1 and C2, sequences crossing several paged blocks, decode-like runs of
consecutive queries of one sequence (scored together by the kernel) and scattered ones; exact equality."""
from __future__ import annotations

import pytest
import torch

from openinfer.layers import cpu_ops
from openinfer.models.deepseek_v41.indexer import Indexer, candidate_blocks, candidate_mask, select_topk

BS = 16


def _problem(ratio, dtype, gen, lens=(37, 150, 5, 90), nh=3, d=20, bs=BS):
    """Index keys paged through shuffled block tables (every slot no sequence owns is NaN), and queries: the last
    11 positions of each sequence (runs longer than the kernel's group of 8) plus a few early ones."""
    cap = bs // ratio
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(need) + 1, dtype=torch.long)  # a padding column, as the engine's
    keys = torch.full((num_blocks * cap, d), float("nan"))
    for s, nb in enumerate(need):
        tables[s, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
        for b in range(nb):
            keys[tables[s, b] * cap:(tables[s, b] + 1) * cap] = torch.randn(cap, d, generator=gen)
    seq, pos = [], []
    for s, n in enumerate(lens):
        for p in list(range(max(0, n - 11), n)) + [0, 1, min(n - 1, 17)]:
            seq.append(s)
            pos.append(p)
    token_seq, positions = torch.tensor(seq), torch.tensor(pos)
    q = torch.randn(len(seq), nh, d, generator=gen).to(dtype)
    head_w = torch.randn(len(seq), nh, generator=gen)
    head_w[::5, 0] = 0.0  # a head that adds exact zeros
    return keys.to(dtype), tables, token_seq, positions, q, head_w, cap


def _torch_scores(idx, keys, tables, token_seq, visible, q, head_w, ratio, cap, bs=BS):
    width = int(visible.max())
    w = torch.arange(width)
    end = (w + 1) * ratio - 1
    slots = tables[token_seq[:, None], end[None, :] // bs] * cap + (end[None, :] % bs) // ratio
    return idx.score(q, head_w, torch.nan_to_num(keys[slots].float()).to(keys.dtype)), width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("k", [5, 64])  # 64: more than some queries see (-1 pads)
def test_indexer_select_matches_torch(kernel_ops, dtype, ratio, k):
    gen = torch.Generator().manual_seed(ratio * 100 + k)
    keys, tables, token_seq, positions, q, head_w, cap = _problem(ratio, dtype, gen)
    visible = (positions + 1) // ratio
    nh, d = q.shape[1:]
    idx = Indexer(8, 8, 8, nh, d, False, 1e-6)
    scores, width = _torch_scores(idx, keys, tables, token_seq, visible, q, head_w, ratio, cap)
    cblock, nblocks = 3, 4
    pad = lambda c: torch.cat([c, c.new_full((c.shape[0], k - c.shape[1]), -1)], 1) if c.shape[1] < k else c

    # a plain index layer, and the candidate source (its top-k and its candidate blocks)
    got, none = cpu_ops.indexer_select(q, head_w, keys, tables, token_seq, visible, k, d ** -0.5, ratio, BS, cap)
    assert none is None
    assert torch.equal(got, pad(select_topk(scores, visible, k)))
    got, blocks = cpu_ops.indexer_select(q, head_w, keys, tables, token_seq, visible, k, d ** -0.5, ratio, BS, cap,
                                         cblock, nblocks)
    want_blocks = candidate_blocks(scores, visible, cblock, nblocks)
    assert torch.equal(blocks, want_blocks) and torch.equal(got, pad(select_topk(scores, visible, k)))

    # a restricted layer: random candidate blocks per query, -1 pads and a block past what the query sees
    allowed = torch.randint(0, -(-width // cblock) + 2, (q.shape[0], nblocks), generator=gen)
    allowed[::3, -1] = -1
    allowed[:4] = want_blocks[:4]
    got, _ = cpu_ops.indexer_select(q, head_w, keys, tables, token_seq, visible, k, d ** -0.5, ratio, BS, cap,
                                    cblock, 0, allowed)
    want = select_topk(scores, visible, k, candidate_mask(allowed, width, cblock))
    assert torch.equal(got, pad(want))


@pytest.mark.parametrize("ratio", [1, 2])
def test_indexer_select_ties_and_non_finite_scores(kernel_ops, ratio):
    """The kernel's radix top-k on scores that a plain random problem never gives: small integer q, keys and head
    weights with d = 16 (scale 1/4), so every score is exact whatever the summation order and few distinct values
    fill long rows (ties that survive all 32 bits of the radix select: the lowest entries must win); a query with
    q = 0 (every score 0); and non-finite scores from an infinite or NaN head weight (inf * relu 0 = NaN). The
    ranking must be torch's stable descending sort (NaN first, then +inf, ..., -inf; ties -> lowest), the candidate
    blocks its amax (a NaN in a block makes its max NaN). One sequence of 700 positions gives the passes long rows;
    paged blocks of 12 tokens take the kernel's slot arithmetic by division (16: by shifts)."""
    gen = torch.Generator().manual_seed(7 + ratio)
    bs = 12
    keys, tables, token_seq, positions, q, head_w, cap = _problem(ratio, torch.float32, gen, lens=(37, 700, 90),
                                                                  d=16, bs=bs)
    owned = ~keys.isnan().any(dim=1)
    keys[owned] = torch.randint(-2, 3, (int(owned.sum()), keys.shape[1]), generator=gen).float()
    q = torch.randint(-2, 3, q.shape, generator=gen).float()
    head_w = torch.randint(-2, 3, head_w.shape, generator=gen).float()
    q[3] = 0.0
    head_w[5, 0], head_w[20, 1], head_w[30, 2] = float("inf"), float("-inf"), float("nan")
    visible = (positions + 1) // ratio
    nh, d = q.shape[1:]
    idx = Indexer(8, 8, 8, nh, d, False, 1e-6)
    scores, width = _torch_scores(idx, keys, tables, token_seq, visible, q, head_w, ratio, cap, bs)
    assert scores.isnan().any() and scores.isposinf().any() and scores.isneginf().any()
    for k in (7, 300):
        pad = lambda c: torch.cat([c, c.new_full((c.shape[0], k - c.shape[1]), -1)], 1) if c.shape[1] < k else c
        got, blocks = cpu_ops.indexer_select(q, head_w, keys, tables, token_seq, visible, k, d ** -0.5, ratio, bs,
                                             cap, 5, 6)
        assert torch.equal(got, pad(select_topk(scores, visible, k)))
        want_blocks = candidate_blocks(scores, visible, 5, 6)
        assert torch.equal(blocks, want_blocks)
        # restricted: torch masks the entries outside the blocks to -inf, which then tie with real -inf scores
        # (and may outrank them by a lower index): compared on the queries without -inf scores
        got, _ = cpu_ops.indexer_select(q, head_w, keys, tables, token_seq, visible, k, d ** -0.5, ratio, bs, cap,
                                        5, 0, want_blocks)
        want = pad(select_topk(scores, visible, k, candidate_mask(want_blocks, width, 5)))
        rows = ~scores.isneginf().any(dim=1)
        assert torch.equal(got[rows], want[rows])


def test_candidate_mask_marks_the_listed_blocks():
    blocks = torch.tensor([[2, -1, 0], [-1, -1, -1], [4, 4, 1]])
    want = torch.tensor([[(w // 3) in set(r) for w in range(13)] for r in blocks.tolist()])
    assert torch.equal(candidate_mask(blocks, 13, 3), want)


def test_indexer_select_rejects_tables_outside_the_store(kernel_ops):
    gen = torch.Generator().manual_seed(3)
    keys, tables, token_seq, positions, q, head_w, cap = _problem(2, torch.float32, gen)
    bad = tables.clone()
    bad[1, 2] = keys.shape[0] // cap
    with pytest.raises(RuntimeError, match="outside the store"):
        cpu_ops.indexer_select(q, head_w, keys, bad, token_seq, (positions + 1) // 2, 4, 0.1, 2, BS, cap)
