"""Bad input gets a clear ValueError naming the field and limit, and the engine keeps working."""
from __future__ import annotations

import json
import shutil

import pytest

from helpers import make_dense_checkpoint
from openinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_dense_checkpoint(tmp_path_factory.mktemp("m"), "llama", max_position_embeddings=128)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), dtype="float32", kv_cache_memory_gb=0.02)


def works(llm):
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1
    s = llm.engine.stats()
    assert s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_blocks


def test_prompt_longer_than_max_model_len_names_both_numbers(llm):
    with pytest.raises(ValueError, match=r"prompt has 200 tokens, but max_model_len is 128"):
        llm.generate([{"prompt_token_ids": [5] * 200}], SamplingParams(), use_tqdm=False)
    works(llm)


def test_bad_batch_is_all_or_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5] * 500}], SamplingParams(),
                     use_tqdm=False)
    works(llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2), "min_p"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-9), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(n=0), "n"),
    (dict(logprobs=100), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=float("inf")), "top_p"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(temperature="hot"), "temperature"),
    # past int64: a tensor (top_k in the sampler) or msgpack (the worker wire) cannot hold these
    (dict(top_k=2**70), "top_k"),
    (dict(seed=-2**64), "seed"),
    (dict(max_tokens=2**64), "max_tokens"),
    (dict(stop_token_ids=[2**64]), "stop_token_ids"),
    (dict(allowed_token_ids=[2**70]), "allowed_token_ids"),
    (dict(logit_bias={2**70: 1.0}), "logit_bias"),
])
def test_sampling_values_rejected_with_field_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(stop_token_ids=[256], min_tokens=2), r"stop_token_ids has token ids outside the vocabulary \[0, 256\)"),
    (dict(logit_bias={300: 1.0}), r"logit_bias has token ids outside the vocabulary"),
    (dict(allowed_token_ids=[5, 256]), r"allowed_token_ids has token ids outside the vocabulary"),
    (dict(allowed_token_ids=[5] * 257), r"allowed_token_ids has 257 items, more than the limit of 256"),
    (dict(n=129), r"n must be at most 128, got 129"),
    (dict(stop=[f"s{i}" for i in range(65)]), r"stop has 65 items, more than the limit of 64"),
    (dict(stop=["x" * 257]), r"stop has a string of 257 characters, more than the limit of 256"),
    (dict(stop_token_ids=[5] * 1025), r"stop_token_ids has 1025 items, more than the limit of 1024"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), r"logit_bias has 1025 items"),
    (dict(bad_words=["w"] * 129), r"bad_words has 129 items, more than the limit of 128"),
    (dict(bad_words=["w" * 300]), r"bad_words has a string of 300 characters"),
    (dict(structured_outputs={"regex": "a" * 300_000}), r"structured_outputs.regex is too large: 300000 characters"),
])
def test_values_past_the_vocabulary_or_caps_rejected_by_the_engine(llm, kwargs, message):
    """Checked when the request is added (the vocabulary and the caps are the engine's), before anything runs: a
    stop token id past the vocabulary with min_tokens used to fail the sampler, and with it the whole batch."""
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(**kwargs), use_tqdm=False)
    works(llm)


def test_the_engine_holds_requests_to_its_own_request_limits(llm):
    """The server sets its caps (--max-stop-strings, ...) on the engine, whose add_request checks them again: a cap
    the server raised must not be refused by the default one (a 400 without a field, before)."""
    from openinfer.request_limits import DEFAULT_LIMITS, RequestLimits

    stops = [f"s{i}" for i in range(80)]
    with pytest.raises(ValueError, match="stop has 80 items, more than the limit of 64"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(stop=stops, max_tokens=2), use_tqdm=False)
    llm.engine.request_limits = RequestLimits(max_stop_strings=100)
    try:
        out = llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(stop=stops, max_tokens=2, ignore_eos=True),
                           use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) >= 1
    finally:
        llm.engine.request_limits = DEFAULT_LIMITS
    works(llm)


def test_error_messages_do_not_echo_huge_values():
    with pytest.raises(ValueError) as e:
        SamplingParams(stop=[""] * 100_000)
    assert len(str(e.value)) < 300 and "100000 items" in str(e.value)
    with pytest.raises(ValueError) as e:
        SamplingParams(top_k=10**5000)
    assert "top_k" in str(e.value) and len(str(e.value)) < 300


def test_unknown_sampling_argument_rejected():
    with pytest.raises(TypeError, match="bogus"):
        SamplingParams(bogus=1)


def test_bad_prompts(llm):
    for bad, msg in [({"prompt_token_ids": []}, "must not be empty"),
                     ({"prompt_token_ids": [1, 10_000]}, r"\[0, 256\)"),
                     ({"prompt_token_ids": [1, "x"]}, "integers"),
                     ("", "non-empty"), (3.5, "prompt must be"), ({"text": "x"}, "prompt_token_ids")]:
        with pytest.raises(ValueError, match=msg):
            llm.generate([bad], SamplingParams(), use_tqdm=False)
    works(llm)


def test_request_larger_than_whole_cache_rejected(ckpt):
    small = LLM(str(ckpt), dtype="float32", num_kv_blocks=4)
    with pytest.raises(ValueError, match=r"needs up to \d+ KV blocks .* has 4 blocks"):
        small.generate([{"prompt_token_ids": [5] * 60}], SamplingParams(max_tokens=20), use_tqdm=False)
    works(small)


def test_missing_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model")


def test_unsupported_architecture_lists_supported(tmp_path, ckpt):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel' is not supported; .*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(bad))


def test_truncated_safetensors(tmp_path, ckpt):
    bad = tmp_path / "trunc"
    shutil.copytree(ckpt, bad)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        LLM(str(bad), dtype="float32")


def test_missing_tensor_and_wrong_shape(tmp_path, ckpt):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    bad = tmp_path / "missing"
    shutil.copytree(ckpt, bad)
    t2 = dict(tensors)
    t2.pop("model.norm.weight")
    save_file(t2, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="missing .*model.norm.weight"):
        LLM(str(bad), dtype="float32")
    t3 = dict(tensors)
    t3["model.norm.weight"] = t3["model.norm.weight"][:10].clone()
    save_file(t3, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        LLM(str(bad), dtype="float32")


def test_bad_engine_options(ckpt):
    for kw, msg in [(dict(dtype="int8"), "dtype"), (dict(max_model_len=10_000), "max_position_embeddings"),
                    (dict(block_size=12), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
                    (dict(attention_backend="flash"), "attention_backend"), (dict(num_kv_blocks=1), "num_kv_blocks"),
                    (dict(device="cuda:7"), "device") if not __import__("torch").cuda.is_available() else
                    (dict(dtype="int8"), "dtype")]:
        with pytest.raises(ValueError, match=msg):
            LLM(str(ckpt), **kw)


def test_pickle_checkpoints_are_refused(tmp_path, ckpt):
    d = tmp_path / "pt"
    d.mkdir()
    shutil.copy(ckpt / "config.json", d / "config.json")
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickle"):
        LLM(str(d), tokenizer=str(ckpt))


def test_request_limits_are_configurable_from_the_command_line():
    import argparse

    from openinfer.request_limits import RequestLimits

    p = argparse.ArgumentParser()
    RequestLimits.add_cli_args(p)
    limits = RequestLimits.from_cli_args(p.parse_args(["--max-stop-strings", "2", "--max-n", "3"]))
    assert limits == RequestLimits(max_stop_strings=2, max_n=3)
    with pytest.raises(ValueError, match="stop has 3 items, more than the limit of 2"):
        SamplingParams(stop=["a", "b", "c"]).check_limits(256, limits)
    with pytest.raises(ValueError, match="RequestLimits.max_n must be an integer >= 1"):
        RequestLimits.from_cli_args(p.parse_args(["--max-n", "0"]))


def test_a_rendered_chat_prompt_past_max_chars_is_refused_before_tokenizing(llm, monkeypatch):
    from openinfer.tokenizer import PromptTooLong, apply_chat_template

    tok = llm.engine.tokenizer
    template = "{{ tools | tojson }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 50_000}}]
    encoded = []
    monkeypatch.setattr(tok, "encode", lambda *a, **k: encoded.append(a) or [])
    with pytest.raises(PromptTooLong) as e:
        apply_chat_template(tok, [{"role": "user", "content": "hi"}], True, template, max_chars=10_000, tools=tools)
    assert e.value.num_chars > 50_000 and not encoded
    apply_chat_template(tok, [{"role": "user", "content": "hi"}], True, template, max_chars=10_000)
    assert encoded
