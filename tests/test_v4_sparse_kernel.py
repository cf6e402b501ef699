"""DeepSeek-V4's windowed + sparse attention kernel (cpu_kernels/sparse_attention.cpp) against the torch code it
replaces (attention.sink_attention over gathered keys)."""
from __future__ import annotations

import pytest
import torch

from openinfer.layers import cpu_ops
from openinfer.models.deepseek_v4.attention import sink_attention


def _problem(lens, bs, d, n_entries, e_per_query, dtype, gen):
    """Paged token store with every slot no sequence owns set to NaN; an entry store whose unselected rows are
    NaN; queries at every position of every sequence (a prefill) with random entry choices padded by -1."""
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 2
    kv = torch.full((num_blocks * bs, d), float("nan"))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(need), dtype=torch.long)
    for s, (n, nb) in enumerate(zip(lens, need)):
        tables[s, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
        for p in range(n):
            kv[tables[s, p // bs] * bs + p % bs] = torch.randn(d, generator=gen)
    entries = torch.full((n_entries, d), float("nan"))
    used = torch.randperm(n_entries, generator=gen)[: n_entries // 2]
    entries[used] = torch.randn(len(used), d, generator=gen)
    token_seq = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)])
    positions = torch.cat([torch.arange(n) for n in lens])
    t = len(token_seq)
    slots = used[torch.randint(len(used), (t, e_per_query), generator=gen)]
    slots[torch.rand(t, e_per_query, generator=gen) < 0.3] = -1
    return kv.to(dtype), entries.to(dtype), tables, token_seq, positions, slots


def _reference(q, kv, entries, tables, token_seq, positions, bs, window, slots, sinks, scale):
    out = torch.empty(q.shape)
    for t in range(q.shape[0]):
        s, p = int(token_seq[t]), int(positions[t])
        rows = [kv[tables[s, i // bs] * bs + i % bs] for i in range(max(0, p - window + 1), p + 1)]
        rows += [entries[e] for e in slots[t].tolist() if e >= 0]
        keys = torch.stack(rows).float()[None]
        out[t] = sink_attention(q[t:t + 1].float(), keys, torch.ones(1, keys.shape[1], dtype=torch.bool), sinks,
                                scale)[0]
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("d, heads", [(64, 4), (40, 3)])
@pytest.mark.parametrize("window, e_per_query", [(8, 5), (24, 0), (16, 20)])
def test_sparse_kernel_matches_torch(kernel_ops, dtype, tol, d, heads, window, e_per_query):
    gen = torch.Generator().manual_seed(d + window + e_per_query)
    bs, lens = 16, [1, 17, 40, 5]
    kv, entries, tables, seq, pos, slots = _problem(lens, bs, d, 30, e_per_query, dtype, gen)
    q = torch.randn(len(seq), heads, d, generator=gen).to(dtype)
    sinks = torch.randn(heads, generator=gen)
    scale = d ** -0.5
    got = cpu_ops.sink_sparse_attention(q, kv, tables, seq, pos, bs, window, entries if e_per_query else None,
                                        slots if e_per_query else None, sinks, scale)
    assert got is not None and not got.isnan().any()
    want = _reference(q, kv, entries, tables, seq, pos, bs, window, slots if e_per_query else slots[:, :0], sinks,
                      scale)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_sparse_kernel_rejects_rows_outside_the_stores(kernel_ops):
    gen = torch.Generator().manual_seed(1)
    kv, entries, tables, seq, pos, slots = _problem([20], 16, 32, 10, 2, torch.float32, gen)
    q = torch.randn(len(seq), 2, 32, generator=gen)
    sinks = torch.zeros(2)
    bad = tables.clone()
    bad[0, 1] = kv.shape[0]
    with pytest.raises(RuntimeError, match="outside the store"):
        cpu_ops.sink_sparse_attention(q, kv, bad, seq, pos, 16, 8, None, None, sinks, 0.1)
    bad_slots = slots.clone()
    bad_slots[3, 0] = entries.shape[0]
    with pytest.raises(RuntimeError, match="outside the store"):
        cpu_ops.sink_sparse_attention(q, kv, tables, seq, pos, 16, 8, entries, bad_slots, sinks, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 4, 7])  # k <= the widest visible set, as select() asks
def test_indexer_topk_matches_torch(kernel_ops, dtype, k):
    """Scores as Indexer.score computes them, then the stable descending sort's first k; ReLU makes many scores
    exactly 0, so ties are common and must go to the lowest entry. NaN in every entry slot no query may see."""
    from openinfer.models.deepseek_v4.indexer import Indexer

    gen = torch.Generator().manual_seed(k)
    t, nh, d, w, s = 23, 4, 16, 7, 3
    keys = torch.full((40, d), float("nan"))
    seq_slots = torch.randperm(40, generator=gen)[: s * w].view(s, w)
    visible = torch.randint(0, w + 1, (t,), generator=gen)
    token_seq = torch.randint(0, s, (t,), generator=gen)
    for i in range(t):  # only what some query sees holds a value
        keys[seq_slots[token_seq[i], : visible[i]]] = 0.0
    seen = ~keys[:, 0].isnan()
    keys[seen] = torch.randn(int(seen.sum()), d, generator=gen)
    keys = keys.to(dtype)
    q = torch.randn(t, nh, d, generator=gen).to(dtype)
    head_w = torch.rand(t, nh, generator=gen)
    head_w[:, 0] = 0.0  # a head that adds exact zeros
    got = cpu_ops.indexer_topk(q, head_w, keys, seq_slots, token_seq, visible, k, d ** -0.5)
    gathered = torch.nan_to_num(keys[seq_slots[token_seq]].float())  # [t, w, d]; unseen rows are masked below
    idx = Indexer(8, 8, nh, d, 4, k, 1e-6)
    scores = idx.score(q, head_w, gathered).masked_fill(torch.arange(w)[None] >= visible[:, None], float("-inf"))
    want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    want = torch.where(want < visible[:, None], want, torch.full_like(want, -1))
    assert torch.equal(got, want)


def test_v4_model_same_with_and_without_kernels_fp32(kernel_ops, tmp_path, monkeypatch):
    """The tiny V4 model (SWA, CSA with the indexer, HCA layers; hash and learned MoE) generating with every CPU
    kernel on and with OPENINFER_CPU_KERNELS=0: the same greedy tokens, log-probs equal to fp32 rounding."""
    import importlib.util
    from pathlib import Path

    from openinfer import LLM, SamplingParams

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("make_v4", root / "scripts" / "make_deepseek_v4_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ckpt = mod.make_checkpoint(tmp_path / "tiny", "tiny", seed=1)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(6, 256, (n,), generator=g).tolist() for n in (3, 45, 20)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv("OPENINFER_CPU_KERNELS", on)
        llm = LLM(str(ckpt), dtype="float32", max_model_len=128, num_kv_blocks=64)
        runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False))
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for j, t in enumerate(a.outputs[0].token_ids):
            assert abs(a.outputs[0].logprobs[j][t] - b.outputs[0].logprobs[j][t]) < 1e-4
