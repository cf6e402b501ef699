"""DeepSeek-V4.1 in openinfer: a tiny checkpoint in DeepInfer's exact format (names, FP8 block-32 UE8M0, MXFP4
experts, FP8 Engram tables) loads; the engine's paged path agrees with the plain whole-sequence reference
(reference.py: no cache, full recompute) token for token, logprobs within 1e-4 in fp32, through mixed batches,
8-token prefill chunks, prefix-cache hits (also after the window blocks were released) and forced preemption;
malformed checkpoints fail naming the field.

The tiny model (scripts/make_deepseek_v41_checkpoint.py) has every V4.1 delta: SWA layers 0-1, Engram on 1 and 3,
C2 layers 2-4 sharing layer 2's KV and index keys (layer 3 also its top-k, layer 4 its own top-k), C1 layers 5-7
from the YOCO boundary 5 (layer 6 sharing 5's KV and top-k, layer 7 compressing its own KV from the shared hidden
and restricted to the candidate blocks chosen at 5), window 8, index_topk 4, shifted mHC.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from openinfer import LLM, SamplingParams
from openinfer.layers.fp8 import E8M0_DTYPE, FP8_DTYPE
from openinfer.layers.rotary import apply_interleaved
from openinfer.models.deepseek_v41.reference import reference_logits
from openinfer.models.weights import WeightLoadError
from tests.helpers import engine_model, kv_manager, load_script, random_prompts

NEW_TOKENS = 10
LENGTHS = [3, 17, 30, 41, 52]


def _generator():
    return load_script("make_deepseek_v41_checkpoint")


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    return random_prompts(seed, lengths)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return _generator().make_checkpoint(tmp_path_factory.mktemp("v41") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts(1, LENGTHS)


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int = NEW_TOKENS):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _assert_matches_reference(llm: LLM, prompts: list[list[int]], outs) -> None:
    """Teacher-forced on the engine's own tokens: the reference's argmax at every generated position must be
    the engine's token (so the reference's greedy output is the same) and the logprobs agree."""
    model = engine_model(llm)
    for i, (p, out) in enumerate(zip(prompts, outs)):
        toks = out.outputs[0].token_ids
        lp = torch.log_softmax(reference_logits(model, p + toks), dim=-1)[len(p) - 1:-1]
        assert lp.argmax(dim=-1).tolist() == toks, f"prompt {i}: engine {toks} != reference"
        diff = max(abs(out.outputs[0].logprobs[j][t] - float(lp[j, t])) for j, t in enumerate(toks))
        assert diff < 1e-4, f"prompt {i}: logprob differs from the reference by {diff}"


def test_checkpoint_is_in_deepinfer_format_and_loads(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v41" and "text_config" in cfg
    assert cfg["quantization_config"]["weight_block_size"] == [32, 32]
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("layers.0.attn.wq_a.weight").dtype == FP8_DTYPE
        assert f.get_tensor("layers.0.attn.wq_a.scale").dtype == E8M0_DTYPE
        assert tuple(f.get_tensor("layers.0.attn.wq_a.scale").shape) == (2, 4)  # [64, 128] in 32x32 blocks
        assert f.get_tensor("layers.2.ffn.experts.0.w1.weight").dtype == torch.int8  # MXFP4, two per byte
        table = f.get_tensor("layers.1.engram.embed.weight")
        assert table.dtype == FP8_DTYPE and tuple(f.get_tensor("layers.1.engram.embed.scale").shape) == (
            table.shape[0], 1)  # one UE8M0 scale per 32 values of a row
    # Only sources hold what they share (DeepInfer's builder): compressors at KV sources, indexers at index
    # sources, key projections at index-K sources.
    assert {n for n in names if ".compressor.wkv." in n} == {f"layers.{i}.attn.compressor.wkv.weight" for i in (2, 5, 7)}
    assert {n for n in names if ".indexer.wq_b.weight" in n} == {f"layers.{i}.attn.indexer.wq_b.weight"
                                                              for i in (2, 4, 5, 7)}
    assert {n for n in names if ".indexer.wk." in n} == {f"layers.{i}.attn.indexer.wk.weight" for i in (2, 5, 7)}
    assert "layers.5.attn.compressor.wgate.weight" not in names  # C1 needs no gate
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128, num_kv_blocks=32)
    model = engine_model(llm)
    from openinfer.layers.fp8 import dequantize_fp8_block

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        want = dequantize_fp8_block(f.get_tensor("layers.1.engram.embed.weight"),
                                    f.get_tensor("layers.1.engram.embed.scale"), (1, 32), torch.float32)
    assert torch.equal(model.model.layers[1].engram.embed.weight, want)
    # KV: entries / index keys only at sources; what the engine logs is what it allocates.
    caches = [a.cache for a in model.attention_layers()]
    assert [sorted(c.names) for c in caches] == [["kv"], ["kv"], ["comp", "entries", "index_keys", "kv"], ["kv"],
                                                 ["kv"], ["entries", "index_keys", "kv"], ["kv"],
                                                 ["entries", "index_keys", "kv"]]
    blocks = llm.engine.num_kv_blocks
    allocated = sum(getattr(c, n).nbytes for c in caches for n in c.names) + model.model.ids_store.nbytes
    assert allocated == sum(g.bytes_per_block * blocks[g.name] for g in model.kv_cache_spec(16, torch.float32))
    assert f"{llm.engine.kv_bytes_per_token} bytes/token steady state" in llm.engine.startup_message


@pytest.mark.parametrize("budget", [None, 4096])  # 4096 B: every query its own chunk
def test_one_mixed_batch_matches_reference(ckpt, prompts, budget, monkeypatch):
    if budget is not None:
        from openinfer.models.deepseek_v41 import attention

        monkeypatch.setattr(attention, "GATHER_BUDGET_BYTES", budget)
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128, num_kv_blocks=64)
    outs = _run(llm, prompts)
    _assert_matches_reference(llm, prompts, outs)


def test_chunked_prefill_and_prefix_cache_hits(ckpt, prompts):
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=8,
              num_kv_blocks=128)
    outs = _run(llm, prompts[2:], 6)
    _assert_matches_reference(llm, prompts[2:], outs)
    g = torch.Generator().manual_seed(7)
    branches = [prompts[i][:cut] + torch.randint(6, 256, (5,), generator=g).tolist()
                for i, cut in ((4, 21), (3, 40), (2, 17))]
    outs = _run(llm, branches, 6)
    assert [o.num_cached_tokens for o in outs] == [16, 40, 16]
    _assert_matches_reference(llm, branches, outs)
    assert kv_manager(llm).all_free()


def test_prefix_hit_after_window_blocks_were_released(ckpt, prompts):
    """A long generation releases its window blocks behind the lookback; they keep their hashes, so a request
    sharing its prompt + output gets a hit served by released (free, still cached) blocks."""
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=16,
              num_kv_blocks=64)
    eng, kv = llm.engine, kv_manager(llm)
    window = kv.groups[1]
    assert window.lookback_tokens == 7  # window 8; C2 reads 1 back; Engram 2 back
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request("long", {"prompt_token_ids": prompts[2]}, sp)
    released, out = 0, None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        if "long" in window.tables:
            released = max(released, window.tables["long"].count(None))
    assert released >= 5
    history = prompts[2] + out.outputs[0].token_ids
    g = torch.Generator().manual_seed(11)
    later = history[:60] + torch.randint(6, 256, (3,), generator=g).tolist()
    outs = _run(llm, [later], 6)
    assert outs[0].num_cached_tokens == 56
    _assert_matches_reference(llm, [later], outs)
    assert kv.all_free()


def test_preemption_recomputes_identically(ckpt, prompts):
    llm = LLM(str(ckpt), dtype="float32", max_model_len=128, num_kv_blocks=9, max_num_batched_tokens=64)
    outs = _run(llm, prompts[2:])
    assert llm.engine.stats().num_preemptions > 0
    _assert_matches_reference(llm, prompts[2:], outs)
    assert kv_manager(llm).all_free()


def _broken_copy(ckpt: Path, dst: Path, drop: str | None = None, add: dict | None = None,
                 text: dict | None = None) -> Path:
    import shutil

    shutil.copytree(ckpt, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    if drop:
        tensors = {k: v for k, v in tensors.items() if not k.startswith(drop)}
    tensors.update(add or {})
    save_file(tensors, str(dst / "model.safetensors"))
    if text:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["text_config"].update(text)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_malformed_checkpoints_name_the_field(ckpt, tmp_path):
    with pytest.raises(ValueError, match="compress_ratios has 8 entries"):
        LLM(str(_broken_copy(ckpt, tmp_path / "a", text={"compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1]})),
            dtype="float32", max_model_len=64, num_kv_blocks=8)
    with pytest.raises(ValueError, match="index_source_layer_ids holds unknown layer ids \\[11\\]"):
        LLM(str(_broken_copy(ckpt, tmp_path / "b", text={"index_source_layer_ids": [2, 4, 5, 7, 11]})),
            dtype="float32", max_model_len=64, num_kv_blocks=8)
    with pytest.raises(WeightLoadError, match="missing .*layers.3.engram.embed.weight"):
        LLM(str(_broken_copy(ckpt, tmp_path / "c", drop="layers.3.engram.embed")), dtype="float32",
            max_model_len=64, num_kv_blocks=8)
    with pytest.raises(WeightLoadError, match="layers.3.attn.compressor.wkv.weight' does not belong"):
        LLM(str(_broken_copy(ckpt, tmp_path / "d", add={"layers.3.attn.compressor.wkv.weight": torch.zeros(64, 128)})),
            dtype="float32", max_model_len=64, num_kv_blocks=8)


@torch.no_grad()
def test_yoco_consumer_window_kv_comes_from_its_own_hidden(ckpt):
    """DeepInfer's V4.1 (HF) config sets ``yoco_swa_share_hidden: False`` (hugging_face/config.py:47, in
    ``_GPT_DEFAULTS``, which ``gpt = AttrDict(_GPT_DEFAULTS, ...)`` at config.py:271 never overrides), so a YOCO
    consumer's sliding-window KV is ``Wkv.A`` of its OWN attn-norm hidden (v4_modules/attn.py:249 and
    ``_project_q_and_swa``, 386-402: the shared-hidden branch at 397 is off); only the compressed KV of a consumer
    kv source is projected from the shared hidden (attn.py:348-350). Layer 6 (a consumer that shares layer 5's KV
    and top-k) against a direct transcription; the shared-hidden variant must differ."""
    from openinfer.models.deepseek_v41 import reference

    llm = LLM(str(ckpt), dtype="float32", max_model_len=64, num_kv_blocks=16)
    model = engine_model(llm)
    cfg = model.config
    assert cfg.topology.n_prefill_layer == 5 and model.model.layers[6].self_attn.yoco_consumer
    g = torch.Generator().manual_seed(4)
    t = 20  # > window 8: the window slides
    h5, h6 = torch.randn(t, cfg.hidden_size, generator=g), torch.randn(t, cfg.hidden_size, generator=g)
    seq = reference._Sequence()
    seq.shared_hidden = h5
    reference.attention(model, 5, h5, seq)
    got = reference.attention(model, 6, h6, seq)

    def transcribed(swa_input: torch.Tensor) -> torch.Tensor:
        a = model.model.layers[6].self_attn
        cos, sin = model.model.rotary[a.rope_name]._compute(torch.arange(t))
        q = apply_interleaved(a.q_b_proj(a.q_a_norm(a.q_a_proj(h6))).view(t, a.num_heads, a.head_dim), cos, sin)
        kv_swa = apply_interleaved(a.kv_norm(a.kv_proj(swa_input)), cos, sin)  # kv_swa_norm(Wkv.A(.)), RoPE
        src = model.model.layers[5].self_attn
        c, s = model.model.rotary[src.rope_name]._compute(torch.arange(t))  # C1: entry w starts at w
        entries = apply_interleaved(seq.entries[5], c, s)
        out = torch.empty_like(q)
        for i in range(t):
            keys = torch.cat([kv_swa[max(0, i - cfg.sliding_window + 1):i + 1], entries[seq.chosen[5][i]]])
            logits = torch.einsum("hd,kd->hk", q[i], keys) * a.scale
            full = torch.cat([logits, a.sinks[:, None].float()], dim=1).softmax(dim=1)
            out[i] = full[:, :-1] @ keys
        return a.project_out(out, cos, sin)

    torch.testing.assert_close(got, transcribed(h6), atol=1e-5, rtol=1e-5)
    assert (got - transcribed(h5)).abs().max() > 1e-3


@pytest.mark.parametrize("chunk", [None, 8])
def test_yoco_shortened_prefill_changes_nothing(ckpt, monkeypatch, chunk):
    """Past the YOCO boundary a prefill computes only the rows the sampled tokens and later steps' windows need
    (model.consumer_rows): greedy tokens and logprobs are those of computing every row
    (OPENINFER_SKIP_UNREAD_ROWS=0), through one mixed batch or 8-token chunks, and rows were in fact skipped.
    With prefix caching on nothing is skipped (a hit may resume at any block) and hits stay exact."""
    prompts = _prompts(9, [5, 29, 44, 61])
    g = torch.Generator().manual_seed(5)
    branches = [prompts[3][:40] + torch.randint(6, 256, (12,), generator=g).tolist(), prompts[2][:33]]
    kw = dict(max_num_batched_tokens=8) if chunk else {}
    results = []
    for skip, caching in (("0", False), ("1", False), ("1", True)):
        monkeypatch.setenv("OPENINFER_SKIP_UNREAD_ROWS", skip)
        llm = LLM(str(ckpt), dtype="float32", max_model_len=128, block_size=8, num_kv_blocks=128,
                  enable_prefix_caching=caching, **kw)
        model = engine_model(llm).model
        plans = []
        consumer_rows = model.consumer_rows
        monkeypatch.setattr(model, "consumer_rows", lambda md, step: plans.append(consumer_rows(md, step)) or plans[-1])
        outs = _run(llm, prompts) + _run(llm, branches)
        assert outs[-2].num_cached_tokens == (40 if caching else 0)
        results.append([(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                        for o in outs])
        skipped = sum(int((~k).sum()) for keeps in plans if keeps is not None for k in keeps)
        assert (skipped > 0) == (skip == "1" and not caching), skipped
        assert kv_manager(llm).all_free()
        if caching:
            _assert_matches_reference(llm, branches, outs[len(prompts):])
    for other in results[1:]:
        for (want_toks, want_lps), (toks, lps) in zip(results[0], other):
            assert toks == want_toks
            assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-5
