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


def _compressor(ratio: int, hidden: int, dim: int, seed: int):
    from openinfer.models.deepseek_v41.compression import Compressor
    comp = Compressor(hidden, dim, ratio, 1e-6)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in comp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return comp


@pytest.mark.parametrize("ratio", [1, 2])
def test_compression_matches_deepinfer_prefill_chunks_and_decode(ratio):
    """Two sequences, each prefilled in two chunks (odd lengths: a C2 pair straddles the chunks and lives in
    DeepInfer's state cache) and then decoded token by token: every entry DeepInfer's
    compress_and_update_state_{prefill,decode}_ref emits, normed with its norm_ref, equals openinfer's pooled
    entry of the same window (openinfer's whole-sequence pooling; DeepInfer rounds the pooled latent to bf16)."""
    ops = oracles.op("compress", "compress_and_update_state_prefill_ref", "compress_and_update_state_decode_ref")
    norm_ref = oracles.op("norm", "norm_ref").norm_ref
    hidden, dim, state_size = 24, 16, 8
    comp = _compressor(ratio, hidden, dim, seed=ratio)
    g = torch.Generator().manual_seed(7)
    lengths, chunks = [13, 10], [[5, 4], [3, 6]]  # then decode to the full length
    h = [torch.randn(n, hidden, generator=g) for n in lengths]
    with torch.no_grad():
        rows = [comp.rows(x) for x in h]
        want = [comp.pool(r[:n // ratio * ratio].view(n // ratio, ratio, -1)) for r, n in zip(rows, lengths)]
    kv_gate = [r.split([dim, dim], -1) if ratio == 2 else (r, torch.zeros_like(r)) for r in rows]
    state = torch.randn(2, state_size, 2, dim)  # garbage where nothing was stored: must not be read
    got: list[list[torch.Tensor]] = [[], []]
    done = [0, 0]
    for c in range(2):  # prefill chunk c of both sequences in one batch
        qlens = [chunks[s][c] for s in range(2)]
        sl = [slice(done[s], done[s] + qlens[s]) for s in range(2)]
        score = torch.cat([kv_gate[s][1][sl[s]] for s in range(2)]).float()
        latent = torch.cat([kv_gate[s][0][sl[s]] for s in range(2)]).float()
        klens = [done[s] + qlens[s] for s in range(2)]
        n_comp = [klens[s] // ratio - done[s] // ratio for s in range(2)]
        cu = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
        out = ops.compress_and_update_state_prefill_ref(
            score, latent, state, torch.tensor([0, 1], dtype=torch.int32), torch.zeros(sum(n_comp), dtype=torch.int32),
            cu(qlens), cu(klens), cu(n_comp), ratio)
        for s, part in enumerate(out.split(n_comp)):
            got[s].extend(part)
        done = klens
    for s in range(2):  # decode one token at a time
        for pos in range(done[s], lengths[s]):
            out = ops.compress_and_update_state_decode_ref(
                kv_gate[s][1][pos:pos + 1].float(), kv_gate[s][0][pos:pos + 1].float(), state,
                torch.tensor([s], dtype=torch.int32), torch.tensor([pos + 1], dtype=torch.int32), 1, ratio)
            if (pos + 1) % ratio == 0:
                got[s].append(out[0])
    for s in range(2):
        entries = norm_ref(torch.stack(got[s]), comp.kv_norm.weight.bfloat16(), comp.kv_norm.eps).float()
        assert entries.shape == want[s].shape
        torch.testing.assert_close(want[s], entries, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_deepinfer(with_residual):
    """openinfer's RMSNorm (V4.1 keeps norm weights in fp32; the fused residual form too) against norm_ref on bf16
    activations: equal within one bf16 rounding (norm_ref rounds the normalised x before the weight product,
    openinfer rounds once after it; DeepInfer's own kernel test allows the same)."""
    from openinfer.layers.norm import RMSNorm
    norm_ref = oracles.op("norm", "norm_ref").norm_ref
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(256, 1e-6, torch.float32)
    with torch.no_grad():
        norm.weight.copy_((torch.randn(256, generator=g) * 0.5 + 1).bfloat16().float())
    x = torch.randn(33, 256, generator=g).bfloat16() * 3
    res = torch.randn(33, 256, generator=g).bfloat16() if with_residual else None
    want = norm_ref(x, norm.weight.bfloat16(), norm.eps, res)
    got = norm(x.clone(), None if res is None else res.clone())
    if with_residual:
        torch.testing.assert_close(got[1], want[1])
        got, want = got[0], want[0]
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)


def _drafter():
    from openinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from tests.test_deepseek_v41 import _generator
    gen = _generator()
    text = {**gen.COMMON, **gen.SIZES["tiny"]}
    text.pop("engram_compressed_vocab_size")
    model = DeepseekV41ForCausalLM(text)
    drafter = model.build_mtp()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model, drafter


def test_dspark_confidence_and_markov_match_deepinfer():
    """Per draft position: confidence = confidence_head_fused_ref(hidden before the norm, the Markov embedding
    of the previous token) at DeepInfer's default temperature 1.0; the Markov correction adds markov_w2(w1)."""
    ref = oracles.op("dflash", "confidence_head_fused_ref").confidence_head_fused_ref
    model, drafter = _drafter()
    last = drafter[-1]
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(5, model.config.hidden_size, generator=g)
    logits = torch.randn(5, model.config.vocab_size, generator=g)
    prev = torch.randint(0, model.config.vocab_size, (5,), generator=g)
    step, conf = drafter.corrected(hidden, logits, prev)
    w1 = last.markov_head.embed.weight[prev]
    want = ref(hidden, last.confidence_head.proj.weight.t().contiguous(), 1.0, w1)
    torch.testing.assert_close(conf, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(step, logits + w1 @ last.markov_head.head.weight.t())


def test_dspark_target_features_match_deepinfer():
    """The drafter's context input: per target layer, the mHC streams averaged (dflash_input_store_ref), the
    layers side by side."""
    from openinfer.models.deepseek_v41.dspark import target_features
    ref = oracles.op("dflash", "dflash_input_store_ref").dflash_input_store_ref
    g = torch.Generator().manual_seed(13)
    streams = [torch.randn(7, 4, 32, generator=g).bfloat16() for _ in range(3)]
    buf = torch.zeros(7, 3 * 32, dtype=torch.bfloat16)
    for i, X in enumerate(streams):
        ref(X, buf[:, i * 32:(i + 1) * 32])
    assert torch.equal(target_features(streams), buf)


def test_dspark_draft_positions_match_deepinfer():
    """Draft inputs sit at a+1 .. a+S and each attends the window a-W+1 .. a then the block's own keys, -1 before
    the sequence start: get_fused_dflash_get_input_ref's positions and kv_index (slots = positions here: one big
    SWA block, offset 0)."""
    from openinfer.models.deepseek_v41.dspark import draft_positions
    ref = oracles.op("get_kv_index", "get_fused_dflash_get_input_ref").get_fused_dflash_get_input_ref
    window, s = 8, 4
    accepted = torch.tensor([0, 3, 7, 8, 40])
    ctx_pos, draft_pos = draft_positions(accepted, window, s)
    # DeepInfer's inputs: one token per request (ftp = its row), positions = accepted, slot = position.
    pos = accepted.int()
    _, positions_out, _, _, _, kv_index = ref(pos.clone(), pos, torch.arange(5, dtype=torch.int32),
                                               torch.zeros(5, dtype=torch.int32), 1 << 20, s, window)
    assert positions_out.view(5, s).tolist() == draft_pos.tolist()
    keys = torch.cat([ctx_pos, draft_pos], dim=1)
    want = kv_index.view(5, s, -1)[:, 0, :window + s]  # every draft row of a request reads the same keys
    assert keys.tolist() == want.tolist()


def _deepinfer_swa_pivots(seqs: list[tuple[int, int]], window: int) -> torch.Tensor:
    """DeepInfer's kv_swa_full_index_pivots for sequences (seqlen_k, seqlen_q), no zero-state recompute: a
    transliteration of csrc/engine/input_metadata/prepare_tensor_input_v4.cpp (the host side builds them). The
    gathered buffer holds, per sequence, the window tokens before its chunk (rows i*W ..), then every chunk token."""
    pivots, i_q, n_seq = [], 0, len(seqs)
    for i, (k_len, q_len) in enumerate(seqs):
        q_start, sec2_start = k_len - q_len, n_seq * window + i_q
        for j in range(q_len):
            lo = max(q_start + j - window + 1, 0)
            start_slot = min(lo, q_start) - (q_start - window)
            k_lo = max(0, lo - q_start)
            pivots.append([i * window + start_slot, window - start_slot, sec2_start + k_lo, j - k_lo + 1])
            i_q += 1
    return torch.tensor(pivots, dtype=torch.int32)


def test_sliding_window_matches_deepinfer():
    """The keys a query's sliding window reads: expand_swa_index_ref over DeepInfer's pivots, mapped from the
    gathered buffer back to token positions, equals openinfer's window (p - W + 1 .. p, none before 0)."""
    from openinfer.models.deepseek_v41.attention import window_positions
    ref = oracles.op("swa_index", "expand_swa_index_ref").expand_swa_index_ref
    window = 8
    seqs = [(5, 5), (20, 7), (9, 1), (13, 12), (30, 3)]  # (tokens so far incl. the chunk, chunk length)
    index = ref(_deepinfer_swa_pivots(seqs, window), window)
    # Gathered row -> token position.
    rows = {}
    for i, (k_len, q_len) in enumerate(seqs):
        for slot in range(window):
            rows[i * window + slot] = k_len - q_len - window + slot
    base = len(seqs) * window
    for k_len, q_len in seqs:
        for j in range(q_len):
            rows[base] = k_len - q_len + j
            base += 1
    positions = torch.tensor([k - q + j for k, q in seqs for j in range(q)])
    win, valid = window_positions(positions, window)
    for t in range(len(positions)):
        want = sorted(rows[int(r)] for r in index[t] if r >= 0)
        assert sorted(win[t][valid[t]].tolist()) == want, t


def test_oracle_loader_refuses_cuda_code_and_skips_without_a_source(monkeypatch, tmp_path):
    """An oracle that needs DeepInfer's compiled ops is refused (only plain-torch functions run); with neither the
    shared copy nor the PyPI sdist reachable the oracle tests skip, naming what is missing."""
    with pytest.raises(RuntimeError, match="not plain torch"):
        oracles.op("candidate_blocks", "candidate_block_max")  # the tilelang kernel's wrapper
    monkeypatch.setattr(oracles, "_root", None)
    monkeypatch.setattr(oracles, "SHARED", tmp_path / "none")
    monkeypatch.setattr(oracles, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(oracles, "SDIST_URL", "http://127.0.0.1:9/deepinfer-0.1.0.tar.gz")
    with pytest.raises(pytest.skip.Exception, match="could not be fetched"):
        oracles.source_root()
