"""The routed-experts kernel for small row counts (cpu_kernels/moe_gemv.cpp) against the torch per-expert loop
(``moe._looped``: matmul in dtype, moe.swiglu, matmul), its dispatch from ``experts_on_sorted_rows``, and the
bit-equality of 1 and 2 threads. bf16 runs both of the kernel's paths where the build has AVX512-BF16 (its
vdpbf16ps path and, with OPENINFER_CPU_BF16_DOT=0, the widening FMA one); elsewhere the FMA one twice."""
from __future__ import annotations

import os

import pytest
import torch

from openinfer.layers import cpu_ops, dispatch, moe
from openinfer.platform import cpu_info

# (counts per expert, H, I): experts with zero rows, one row, R = 1, odd H / I (not multiples of the vector width
# nor of the bf16 pair run, nor of the 4-row block), and the bench model's shape with a few rows each.
CASES = [([0, 1, 0, 0], 37, 19), ([1], 16, 8), ([2, 0, 3, 1, 0], 70, 45), ([0, 0, 1, 2, 0, 1, 3, 0], 512, 256),
         ([5, 4], 100, 33), ([1, 1, 1, 1], 33, 130)]


def _routed_counts(experts: int, topk: int, tokens: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    return torch.bincount(ids.reshape(-1), minlength=experts).tolist()


# Decode steps of a DeepSeek-V3-like layer (32 experts top-6) at batch 1 (six one-row experts, 26 empty) and batch
# 32 (0 to ~12 rows each: one to three chunks of rows), H / I off every block size (32-wide bf16 pair runs, 4-row
# blocks); and experts with 9, 7 and 13 rows (the FMA path's 2-row chunks with a tail; the AVX512-BF16 path's
# chunks of at most 6 split evenly: 5 + 4, 4 + 3, 5 + 4 + 4).
DECODE_CASES = [(_routed_counts(32, 6, 1, 1), 97, 45), (_routed_counts(32, 6, 32, 2), 130, 70),
                ([0, 9, 0], 64, 36), ([7, 0, 13, 6], 96, 40)]


# dtype, OPENINFER_CPU_BF16_DOT: bf16's two paths (on: the AVX512-BF16 one where the build has it; off: the FMA one)
PATHS = pytest.mark.parametrize("dtype, dot", [(torch.float32, "1"), (torch.bfloat16, "1"), (torch.bfloat16, "0")],
                                ids=["fp32", "bf16-dot", "bf16-fma"])


def _data(counts, h, i, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    e = len(counts)
    rows = torch.randn(sum(counts), h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    return rows, w13, w2


def _torch_ref(rows, counts, w13, w2, limit, monkeypatch):
    with monkeypatch.context() as m:  # the plain torch loop, torch swiglu included
        m.setenv("OPENINFER_CPU_KERNELS", "0")
        return moe._looped(rows, w13, w2, counts, limit)


@PATHS
@pytest.mark.parametrize("limit", [None, 0.7])
def test_moe_gemv_matches_torch(kernel_ops, monkeypatch, dtype, dot, limit):
    monkeypatch.setenv("OPENINFER_CPU_BF16_DOT", dot)
    for seed, (counts, h, i) in enumerate(CASES + DECODE_CASES):
        rows, w13, w2 = _data(counts, h, i, dtype, seed)
        y = cpu_ops.moe_experts_gemv(rows, counts, w13, w2, limit)
        assert y is not None and y.dtype == dtype and y.shape == rows.shape
        ref = _torch_ref(rows, counts, w13, w2, limit, monkeypatch)
        scale = max(1.0, float(ref.abs().max()))
        # fp32: summation order only; bf16: the intermediate roundings may land one bf16 step apart
        tol = 1e-5 * scale if dtype == torch.float32 else 3e-2 * scale
        assert (y.float() - ref.float()).abs().max() <= tol, (counts, h, i)
        if limit is not None:  # the clamp is live in these cases: without it the result differs
            assert not torch.allclose(y.float(), cpu_ops.moe_experts_gemv(rows, counts, w13, w2, None).float())
        prev = torch.get_num_threads()
        torch.set_num_threads(2)
        try:  # every output is one dot block whatever the split over threads
            assert torch.equal(cpu_ops.moe_experts_gemv(rows, counts, w13, w2, limit), y)
        finally:
            torch.set_num_threads(prev)


def test_moe_gemv_bf16_dot_row_is_the_same_sum_in_any_chunk(kernel_ops, monkeypatch):
    """On the AVX512-BF16 path each output is one accumulator and one reduction tree whatever rows share its chunk:
    an expert's 13 rows at once (chunks 5 + 4 + 4) give the bits of each row run alone, so batching never changes
    a request's numbers there. (The FMA path gives a lone row two accumulator chains: not this test's claim.)"""
    if not kernel_ops.moe_bf16_dot():
        pytest.skip("this build has no AVX512-BF16 expert path")
    monkeypatch.setenv("OPENINFER_CPU_BF16_DOT", "1")
    counts = [0, 13, 7, 1]
    rows, w13, w2 = _data(counts, 131, 70, torch.bfloat16, 7)
    y = cpu_ops.moe_experts_gemv(rows, counts, w13, w2, 0.7)
    experts = [e for e, c in enumerate(counts) for _ in range(c)]
    for r, e in enumerate(experts):
        alone = [1 if j == e else 0 for j in range(len(counts))]
        assert torch.equal(cpu_ops.moe_experts_gemv(rows[r:r + 1], alone, w13, w2, 0.7), y[r:r + 1]), (r, e)


# The panel-layout experts kernel (cpu_kernels/moe_panels.cpp): I a multiple of 16, H any; row counts per expert from
# 1 to prefill-sized (several 6-row tiles).
PANEL_CASES = [([0, 1, 0, 0], 37, 16), ([1], 16, 16), ([2, 0, 3, 1, 0], 70, 48), ([0, 0, 1, 2, 0, 1, 3, 0], 512, 256),
               ([40, 0, 70], 33, 64), ([600, 3, 0, 1030], 40, 32)]  # the last: experts in row blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [None, 0.7])
def test_moe_panels_matches_torch(kernel_ops, monkeypatch, dtype, limit):
    for seed, (counts, h, i) in enumerate(PANEL_CASES):
        rows, w13, w2 = _data(counts, h, i, dtype, seed)
        p13, p2 = cpu_ops.pack_panels(w13), cpu_ops.pack_panels(w2)
        y = cpu_ops.moe_experts_panels(rows, counts, p13, p2, limit)
        assert y is not None and y.dtype == dtype and y.shape == rows.shape
        ref = _torch_ref(rows, counts, w13, w2, limit, monkeypatch)
        scale = max(1.0, float(ref.abs().max()))
        tol = 1e-5 * scale if dtype == torch.float32 else 3e-2 * scale  # as for moe_gemv above
        assert (y.float() - ref.float()).abs().max() <= tol, (counts, h, i)
        if limit is not None:
            assert not torch.allclose(y.float(), cpu_ops.moe_experts_panels(rows, counts, p13, p2, None).float())
        prev = torch.get_num_threads()
        torch.set_num_threads(2)
        try:  # every output is one fixed-order sum whatever the split over threads
            assert torch.equal(cpu_ops.moe_experts_panels(rows, counts, p13, p2, limit), y)
        finally:
            torch.set_num_threads(prev)


def test_moe_gemv_bf16_dot_where_the_build_has_it(kernel_ops, monkeypatch):
    """The AVX512-BF16 path is chosen exactly where the build has the instruction (the native build on a CPU that
    lists avx512_bf16; never the x86-64-v3 one) and the switch turns it off; the two paths differ only in the
    order of the fp32 sums: some output bits differ, none by more than the bf16 bound."""
    native = "avx512_bf16" in cpu_info()[1] and not os.environ.get("OPENINFER_KERNEL_CFLAGS")
    assert bool(kernel_ops.moe_bf16_dot()) == native and dispatch.active().moe_bf16_dot == native
    counts, h, i = DECODE_CASES[1]
    rows, w13, w2 = _data(counts, h, i, torch.bfloat16, 5)
    y = cpu_ops.moe_experts_gemv(rows, counts, w13, w2, None)
    monkeypatch.setenv("OPENINFER_CPU_BF16_DOT", "0")
    assert not dispatch.active().moe_bf16_dot
    y_fma = cpu_ops.moe_experts_gemv(rows, counts, w13, w2, None)
    assert (y.float() - y_fma.float()).abs().max() <= 3e-2 * max(1.0, float(y_fma.abs().max()))
    assert torch.equal(y, y_fma) != native  # the switch reaches the kernel


@PATHS
def test_moe_gemv_unused_expert_nan_never_read(kernel_ops, monkeypatch, dtype, dot):
    monkeypatch.setenv("OPENINFER_CPU_BF16_DOT", dot)
    counts = [2, 0, 1, 0]
    rows, w13, w2 = _data(counts, 40, 24, dtype, 7)
    clean = cpu_ops.moe_experts_gemv(rows, counts, w13, w2, None)
    w13[1] = float("nan")
    w2[3] = float("nan")
    y = cpu_ops.moe_experts_gemv(rows, counts, w13, w2, None)
    assert torch.isfinite(y).all() and torch.equal(y, clean)


def test_moe_gemv_empty_and_bad_input(kernel_ops):
    rows, w13, w2 = _data([0, 0], 8, 4, torch.float32, 0)
    assert cpu_ops.moe_experts_gemv(rows, [0, 0], w13, w2, None).shape == (0, 8)
    rows, w13, w2 = _data([1, 1], 8, 4, torch.float32, 0)
    with pytest.raises(RuntimeError, match="counts sum to 1, rows has 2"):
        cpu_ops.moe_experts_gemv(rows, [1, 0], w13, w2, None)
    with pytest.raises(RuntimeError, match="w2 must be contiguous"):
        kernel_ops.moe_experts_gemv(torch.empty(2, 8), rows, torch.tensor([1, 1]), w13, w2[:, :4].contiguous(), 1.0,
                                    False)
    # a dtype mix or a GPU-only layout the kernel does not take: None, the caller keeps its torch path
    assert cpu_ops.moe_experts_gemv(rows.bfloat16(), [1, 1], w13, w2, None) is None


def _spy(monkeypatch, panels: str = "0"):
    """Records the experts kernel's calls: the row-major one (``moe_experts_gemv``), or with ``panels`` "1" the
    panel-layout one (fp32 experts are packed into panels by default: ``DeepseekExperts.prepack_cpu``)."""
    monkeypatch.setenv("OPENINFER_CPU_PANELS", panels)
    name = "moe_experts_panels" if panels == "1" else "moe_experts_gemv"
    calls = []
    real = getattr(cpu_ops, name)

    def spy(rows, counts, w13, w2, limit):
        y = real(rows, counts, w13, w2, limit)
        calls.append((rows.shape[0], limit, y is not None))
        return y

    monkeypatch.setattr(cpu_ops, name, spy)
    # the MoE's Python path, whose kernel calls are spied on here (the whole-block op, layers/decode_blocks.py, makes
    # the same calls from C++ and has its own same-bits test: test_decode_blocks.py)
    monkeypatch.setenv("OPENINFER_DECODE_BLOCKS", "0")
    return calls


def _greedy_on_off(path, prompts, monkeypatch, calls, max_tokens=12):
    """Kernels on, then off (the torch path): same greedy tokens, logprobs within summation-order noise. Returns
    the kernel calls of the first run."""
    from openinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    runs = []
    for kernels in ("1", "0"):
        with monkeypatch.context() as m:
            m.setenv("OPENINFER_CPU_KERNELS", kernels)
            llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
            runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
            del llm
        if kernels == "1":
            on_calls = list(calls)
    fast, ref = runs
    for a, b in zip(fast, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for j, t in enumerate(a.outputs[0].token_ids):
            assert abs(a.outputs[0].logprobs[j][t] - b.outputs[0].logprobs[j][t]) < 1e-4
    return on_calls


@pytest.mark.parametrize("panels", ["0", "1"])
def test_v3_greedy_same_with_kernels_on_and_off(tmp_path, monkeypatch, kernel_ops, panels):
    from test_deepseek_v3 import make_hf_v3, make_prompts

    path = make_hf_v3(tmp_path / "v3")
    calls = _greedy_on_off(path, make_prompts((5, 33, 9)), monkeypatch, _spy(monkeypatch, panels))
    assert calls and all(ok for _, _, ok in calls)  # the decode steps' experts ran in the kernel


@pytest.mark.slow  # two DeepSeek-V4 engines per case; the V3 case stays fast
@pytest.mark.parametrize("panels", ["0", "1"])
def test_v4_greedy_same_with_kernels_on_and_off(tmp_path, monkeypatch, kernel_ops, panels):
    from helpers import load_script, random_prompts

    path = load_script("make_deepseek_v4_checkpoint").make_checkpoint(tmp_path / "v4", "tiny", seed=0)
    calls = _greedy_on_off(path, random_prompts(1, [3, 17, 40]), monkeypatch, _spy(monkeypatch, panels))
    assert calls and all(ok for _, _, ok in calls)
    assert any(limit is not None for _, limit, _ in calls)  # V4's swiglu clamp went through the kernel


# The kernel tests above run again on the x86-64-v3 (AVX2) build: tests/test_avx2_variant.py.


def test_v3_bf16_greedy_same_with_bf16_dot_on_and_off(tmp_path, monkeypatch, kernel_ops):
    """bf16 DeepSeek-V3 through the routed-expert kernel's AVX512-BF16 path and its FMA path (the switch): the same
    roundings in another summation order, so the same greedy tokens and logprobs within a few bf16 steps. Where the
    build has no AVX512-BF16 both runs take the FMA path (and must agree bit for bit)."""
    from openinfer import LLM, SamplingParams
    from test_deepseek_v3 import make_hf_v3, make_prompts

    path = make_hf_v3(tmp_path / "v3")
    calls = _spy(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in make_prompts((5, 33, 9))]
    runs = []
    for dot in ("1", "0"):
        monkeypatch.setenv("OPENINFER_CPU_BF16_DOT", dot)
        llm = LLM(model=str(path), dtype="bfloat16", num_kv_blocks=64)
        runs.append(llm.generate(prompts, params, use_tqdm=False))
        del llm
    assert calls and all(ok for _, _, ok in calls)  # prefill and decode experts ran in the kernel
    for a, b in zip(*runs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for j, t in enumerate(a.outputs[0].token_ids):
            assert abs(a.outputs[0].logprobs[j][t] - b.outputs[0].logprobs[j][t]) < 0.05
