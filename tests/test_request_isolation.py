"""A failure that belongs to one request (its sampling row, its detokenizing or stop strings, its grammar) ends that
request alone with an error: its batch neighbours get every token they would have had without it, and every KV
block goes back to the pool."""
from __future__ import annotations

import pytest

from helpers import make_dense_checkpoint
from openinfer import LLM, SamplingParams
from openinfer.engine import detokenizer as detok_mod
from openinfer.structured_outputs import manager as grammar_mod
from openinfer.worker import model_runner as runner_mod

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
VICTIM = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    ckpt = make_dense_checkpoint(tmp_path_factory.mktemp("iso"), "llama", max_position_embeddings=128)
    return LLM(str(ckpt), dtype="float32", kv_cache_memory_gb=0.02)


@pytest.fixture(scope="module")
def reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], VICTIM,
                                                         use_tqdm=False)]


def _run_with_poison(llm, poison: SamplingParams):
    """The victims and one poisoned request in the same batch (the poison in the middle)."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    prompts.insert(2, {"prompt_token_ids": [20, 21, 22]})
    params = [VICTIM] * len(PROMPTS)
    params.insert(2, poison)
    outs = llm.generate(prompts, params, use_tqdm=False)
    poisoned = outs.pop(2)
    return poisoned, outs


def _check(llm, reference, poisoned, victims):
    assert poisoned.outputs[0].finish_reason == "error"
    assert [o.outputs[0].token_ids for o in victims] == reference
    assert all(o.outputs[0].finish_reason == "length" for o in victims)
    s = llm.engine.stats()
    assert s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_blocks


def test_a_sampler_failure_ends_only_its_row(llm, reference, monkeypatch):
    real = runner_mod.sample
    calls = {"batched_failures": 0}

    def sample(logits, rows, generator=None):
        if any(r.params.seed == 666 for r in rows):
            calls["batched_failures"] += len(rows) > 1
            raise RuntimeError("poisoned row")
        return real(logits, rows, generator)

    monkeypatch.setattr(runner_mod, "sample", sample)
    poisoned, victims = _run_with_poison(llm, SamplingParams(temperature=0.5, seed=666, max_tokens=12))
    assert calls["batched_failures"] >= 1  # the poison really shared a batch with the victims
    _check(llm, reference, poisoned, victims)


def test_a_detokenizer_failure_ends_only_its_request(llm, reference, monkeypatch):
    real = detok_mod.IncrementalDetokenizer._add

    def _add(self, token_ids):
        if self.stop == ["poison"]:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned detokenizer")
        return real(self, token_ids)

    monkeypatch.setattr(detok_mod.IncrementalDetokenizer, "_add", _add)
    poisoned, victims = _run_with_poison(llm, SamplingParams(temperature=0, max_tokens=12, stop=["poison"]))
    _check(llm, reference, poisoned, victims)


@pytest.mark.parametrize("method", ["accept", "step_bitmask"])
def test_a_grammar_failure_ends_only_its_request(llm, reference, monkeypatch, method):
    real = getattr(grammar_mod.RequestGrammar, method)

    def broken(self, *args):
        if self.num_calls >= 2:
            raise RuntimeError(f"poisoned grammar {method}")
        self.num_calls += 1
        return real(self, *args)

    monkeypatch.setattr(grammar_mod.RequestGrammar, "num_calls", 0, raising=False)
    monkeypatch.setattr(grammar_mod.RequestGrammar, method, broken)
    poisoned, victims = _run_with_poison(
        llm, SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": "[a-z]{1,30}"}))
    _check(llm, reference, poisoned, victims)
