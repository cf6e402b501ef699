"""DSpark drafter of DeepSeek-V4.1 (standalone; not wired into speculative decoding): loaded from the tiny
checkpoint's mtp.* tensors; target features, context projection, draft attention, Markov correction and
confidence head against plain references."""
from __future__ import annotations

import pytest
import torch

from openinfer import LLM, SamplingParams
from openinfer.layers.rotary import apply_interleaved
from openinfer.models.deepseek_v41.reference import reference_logits
from tests.helpers import engine_model
from tests.test_deepseek_v41 import _generator


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = _generator().make_checkpoint(tmp_path_factory.mktemp("v41d") / "tiny", "tiny", seed=3)
    return LLM(str(path), dtype="float32", max_model_len=128, num_kv_blocks=32)


def test_target_features_match_reference(llm):
    model = engine_model(llm)
    assert model.mtp is not None and len(model.mtp) == 1
    model.model.capture_dspark_features = True
    try:
        prompt = torch.randint(6, 256, (23,), generator=torch.Generator().manual_seed(2)).tolist()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
        got = model.model.dspark_features
    finally:
        model.model.capture_dspark_features = False
    feats: list[torch.Tensor] = []
    reference_logits(model, prompt, feats)
    assert len(feats) == 3 and got.shape == (23, 3 * 128)
    torch.testing.assert_close(got, torch.cat(feats, dim=-1), atol=1e-5, rtol=1e-5)


def _plain_draft_attention(attn, x, main, ctx_pos, draft_pos, rotary):
    """Per query: keys = the context window's projected keys ++ every draft key of its request, sink softmax."""
    b, s = draft_pos.shape
    cos, sin = rotary._compute(draft_pos.reshape(-1))
    q, _, kv = attn.project(x, cos, sin)
    out = torch.empty_like(q)
    for r in range(b):
        keys = []
        for j in range(ctx_pos.shape[1]):
            if ctx_pos[r, j] >= 0:
                c, sn = rotary._compute(ctx_pos[r, j:j + 1])
                keys.append(apply_interleaved(attn.kv_norm(attn.kv_proj(main[r, j:j + 1])), c, sn)[0])
        keys += [kv[r * s + i] for i in range(s)]
        k = torch.stack(keys).float()
        for i in range(s):
            logits = q[r * s + i].float() @ k.t() * attn.scale
            e = torch.exp(logits - logits.max(-1, keepdim=True).values)
            sink = torch.exp(attn.sinks.float() - logits.max(-1).values)
            out[r * s + i] = (e / (e.sum(-1) + sink)[:, None]) @ k
    return attn.project_out(out, cos, sin)


def test_draft_attention_matches_plain(llm):
    model = engine_model(llm)
    attn = model.mtp[0].self_attn
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2 * 4, 128, generator=g)
    main = torch.randn(2, 8, 128, generator=g)
    ctx_pos = torch.tensor([[-1, -1, -1, 0, 1, 2, 3, 4], list(range(30, 38))])
    draft_pos = ctx_pos[:, -1:] + 1 + torch.arange(4)
    rotary = model.model.rotary["main"]
    got = attn.draft(x, main, ctx_pos, draft_pos, rotary)
    torch.testing.assert_close(got, _plain_draft_attention(attn, x, main, ctx_pos, draft_pos, rotary), atol=1e-4,
                               rtol=1e-4)


def test_markov_correction_and_confidence_match_plain(llm):
    model = engine_model(llm)
    last = model.mtp[-1]
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 4, 128, generator=g)
    golden = torch.tensor([7, 99, 250])
    toks, conf = model.mtp.sample(hidden, golden, model.lm_head, temperature=0.5)
    w_head = model.lm_head(torch.eye(128)).t()  # [vocab, D]: the head as a plain matrix
    m1, m2 = last.markov_head.embed.weight, last.markov_head.head(torch.eye(16)).t()  # [V, r], [V, r]
    wc = last.confidence_head.proj(torch.eye(128 + 16))[:, 0]
    for r in range(3):
        prev = int(golden[r])
        for i in range(4):
            h = hidden[r, i]
            normed = torch.nn.functional.rms_norm(h, (128,), last.norm.weight, last.norm.eps)
            logits = w_head @ normed + m2 @ m1[prev]
            want_conf = torch.sigmoid(torch.dot(torch.cat([h, m1[prev]]), wc) / 0.5)
            assert abs(float(conf[r, i]) - float(want_conf)) < 1e-5
            assert int(toks[r, i]) == int(logits.argmax())
            prev = int(toks[r, i])
    # the correction matters: without it some draft differs
    plain = model.lm_head(last.norm(hidden)).argmax(-1)
    assert not torch.equal(plain, toks)


def test_proposals_are_per_request(llm):
    """A batch of requests drafts exactly what each request drafts alone (no leakage across requests)."""
    model = engine_model(llm)
    g = torch.Generator().manual_seed(6)
    feats = torch.randn(2, 8, 3 * 128, generator=g)
    ctx = torch.tensor([[-1, -1, 0, 1, 2, 3, 4, 5], list(range(40, 48))])
    golden = torch.tensor([11, 12])
    toks, conf = model.propose(feats, ctx, golden)
    assert toks.shape == (2, 4) and ((conf > 0) & (conf < 1)).all()
    for r in range(2):
        t1, c1 = model.propose(feats[r:r + 1], ctx[r:r + 1], golden[r:r + 1])
        assert torch.equal(t1[0], toks[r])
        torch.testing.assert_close(c1[0], conf[r])
    other, _ = model.propose(feats.flip(1), ctx, golden)
    assert not torch.equal(other, toks)  # the context features are read
