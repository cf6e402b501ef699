"""DeepSeek-V4.1 pieces against DeepInfer 0.1.0's own pure-torch reference functions (tests/deepinfer_oracles.py
takes them out of DeepInfer's source; nothing of DeepInfer is imported or copied). Random inputs, CPU, fast."""
from __future__ import annotations

import pytest
import torch

from openinfer.models.deepseek_v41 import reference
from openinfer.models.deepseek_v41.indexer import candidate_blocks, candidate_mask, select_topk
from tests import deepinfer_oracles as oracles


def _distinct_scores(g: torch.Generator, rows: int, width: int) -> torch.Tensor:
    """Scores without ties, exact in bf16 (integers below 256): DeepInfer's top-k leaves tie order open."""
    return torch.stack([torch.randperm(width, generator=g) - width // 2 for _ in range(rows)]).float()


def _deepinfer_candidates(ops, scores: torch.Tensor, visible: torch.Tensor, bs: int, k: int) -> list[set[int]]:
    """candidate_block_max_ref, then DeepInfer's top-k over the valid blocks (index_attn._topk_candidate_block)."""
    block_scores, valid_blocks = ops.candidate_block_max_ref(scores.bfloat16(), visible.int(), bs)
    out = []
    for row, n in zip(block_scores.float(), valid_blocks.tolist()):
        out.append(set(torch.topk(row[:n], min(k, n)).indices.tolist()))
    return out


@pytest.mark.parametrize("bs,k", [(2, 8), (8, 4), (16, 3)])
def test_candidate_blocks_match_deepinfer(bs, k):
    """The newest visible block is always a candidate (DeepInfer scores it +inf); before the fix openinfer
    ranked it by its max only and the sets differed on most rows."""
    ops = oracles.op("candidate_blocks", "candidate_block_max_ref")
    g = torch.Generator().manual_seed(bs)
    rows, width = 64, 200
    scores = _distinct_scores(g, rows, width)
    visible = torch.randint(0, width + 1, (rows,), generator=g)
    visible[:3] = torch.tensor([0, 1, width])
    want = _deepinfer_candidates(ops, scores, visible, bs, k)
    got = candidate_blocks(scores, visible, bs, k)
    assert [set(b for b in row if b >= 0) for row in got.tolist()] == want
    # openinfer's own whole-sequence reference agrees too.
    assert [reference.candidate_set(scores[i].tolist(), int(visible[i]), bs, k) for i in range(rows)] == want


@pytest.mark.parametrize("bs", [2, 8, 16])
def test_candidate_restricted_topk_matches_deepinfer(bs):
    """A later index layer's top-k inside the candidate blocks: DeepInfer compacts the candidate blocks' logits
    (ascending block order), takes the top-k over get_candidate_compact_lens_ref tokens and maps the compact
    indices back with restore_candidate_indices_inplace_ref; openinfer masks the full row."""
    ops = oracles.op("candidate_blocks", "get_candidate_compact_lens_ref", "restore_candidate_indices_inplace_ref")
    g = torch.Generator().manual_seed(100 + bs)
    rows, width, n_blocks, k = 48, 160, 6, 9
    scores = _distinct_scores(g, rows, width)
    visible = torch.randint(0, width + 1, (rows,), generator=g)
    blocks = candidate_blocks(scores, visible, bs, n_blocks)
    # DeepInfer's candidate ids come sorted ascending (sorted_index=True), -1 pads after them.
    cand = torch.where(blocks >= 0, blocks, torch.iinfo(torch.int32).max).sort(dim=1).values
    cand = torch.where(cand == torch.iinfo(torch.int32).max, -1, cand).int()
    lens = ops.get_candidate_compact_lens_ref(cand, visible.int(), bs)
    cols = cand.long().clamp_min(0)[:, :, None] * bs + torch.arange(bs)
    compact = scores.gather(1, cols.clamp_max(width - 1).flatten(1))
    compact_valid = (torch.arange(n_blocks * bs) < lens[:, None].long())
    compact = compact.masked_fill(~compact_valid, float("-inf"))
    idx = torch.topk(compact, k, dim=1).indices.int()
    idx = torch.where(torch.arange(k) < lens[:, None], idx, -1)
    ops.restore_candidate_indices_inplace_ref(idx, cand, bs)
    got = select_topk(scores, visible, k, candidate_mask(blocks, width, bs))
    assert [set(r) - {-1} for r in got.tolist()] == [set(r) - {-1} for r in idx.tolist()]
