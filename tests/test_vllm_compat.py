"""vLLM's serve lines, ``LLM()`` keywords and ``SamplingParams`` fields, in process: each flag group parses into the
``EngineArgs`` / server setting it means, a documented no-op says so in one log line, and every flag vLLM has and
openinfer lacks is refused by name (never "unrecognized arguments", never silently dropped). No model is built
here except where a test says so; tests/test_vllm_serve_lines.py starts real servers."""
from __future__ import annotations

import argparse
import logging

import pytest

from openinfer import vllm_compat
from openinfer.engine_args import EngineArgs
from openinfer.entrypoints.cli import build_parser
from openinfer.sampling_params import SamplingParams
from openinfer.server.cli import resolve_vllm_args
from openinfer.vllm_compat import VLLM_FLAGS, human_readable_int, split_llm_kwargs

FIELDS = set(EngineArgs.__dataclass_fields__)


def serve(*argv: str) -> tuple[argparse.Namespace, EngineArgs, list[str]]:
    """``openinfer serve ARGV`` parsed as the command does, up to the engine load."""
    args = build_parser().parse_args(["serve", *argv])
    lines = resolve_vllm_args(args)
    return args, EngineArgs.from_cli_args(args), lines


def refused(capsys, *argv: str, command: str = "serve") -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, *argv])
    assert e.value.code == 2
    return capsys.readouterr().err


# -- the table itself -----------------------------------------------------------------------------------------
def test_every_same_entry_is_a_real_setting_of_the_same_name():
    """A ``same`` entry must be a flag of openinfer serve (and an EngineArgs field when it is an engine flag):
    the table cannot claim a flag openinfer does not have."""
    parser = build_parser()
    serve_parser = parser._subparsers._group_actions[0].choices["serve"]
    for f in VLLM_FLAGS.values():
        if f.kind != "same":
            continue
        assert f.name in serve_parser._option_string_actions, f.name
        if f.scope == "engine":
            assert f.keyword in FIELDS, f"{f.name}: no EngineArgs.{f.keyword}"
        for short in f.short:
            assert serve_parser._option_string_actions[short] is serve_parser._option_string_actions[f.name]


def test_the_table_covers_the_flags_the_issue_names():
    for name in ("--gpu-memory-utilization", "--tensor-parallel-size", "--data-parallel-size", "--max-num-seqs",
                 "--max-num-batched-tokens", "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser",
                 "--trust-remote-code", "--disable-log-requests", "--enforce-eager", "--uvicorn-log-level",
                 "--generation-config", "--seed", "--dtype", "--kv-cache-dtype", "--block-size",
                 "--enable-prefix-caching", "--enable-chunked-prefill", "--max-model-len", "--scheduling-policy",
                 "--api-key", "--host", "--port", "--limit-mm-per-prompt", "--speculative-config",
                 "--kv-transfer-config", "--kv-offloading-backend", "--kv-offloading-size", "--served-model-name"):
        assert name in VLLM_FLAGS, name


@pytest.mark.parametrize("flag", sorted(n for n, f in VLLM_FLAGS.items() if f.kind == "refuse"))
def test_every_refused_flag_is_named_with_its_reason(capsys, flag):
    f = VLLM_FLAGS[flag]
    argv = [flag, "x-unsupported"] if f.takes_value else [flag]
    err = refused(capsys, *argv)
    assert f"supported by vLLM, not by openinfer: {flag} ({f.why})" in err
    assert "unrecognized arguments" not in err


@pytest.mark.parametrize("argv", [["--pipeline-parallel-size", "1"], ["-pp", "1"], ["--cpu-offload-gb", "0"],
                                  ["--load-format", "safetensors"], ["--no-enable-lora"], ["--task", "generate"]])
def test_a_refused_flag_at_openinfers_own_behaviour_is_a_no_op(argv):
    _, _, lines = serve(*argv)
    assert len(lines) == 1 and lines[0].startswith(argv[0] + ": accepted for vLLM compatibility")


# -- flag groups: parsing -> EngineArgs / server settings ----------------------------------------------------
def test_the_issues_serve_line(caplog):
    caplog.set_level(logging.INFO, "openinfer")
    args, ea, lines = serve("--model", "M", "--served-model-name", "tiny", "--gpu-memory-utilization", "0.5",
                            "--max-model-len", "512", "--trust-remote-code", "--enable-auto-tool-choice",
                            "--tool-call-parser", "hermes", "--disable-log-requests")
    assert (ea.model, ea.gpu_memory_utilization, ea.max_model_len) == ("M", 0.5, 512)
    assert args.served_model_name == ["tiny"] and args.tool_call_parser == "hermes"
    assert [line.split(":")[0] for line in lines] == ["--trust-remote-code", "--enable-auto-tool-choice",
                                                      "--disable-log-requests"]
    assert "openinfer runs no code from the checkpoint" in lines[0]
    assert all(line in caplog.text for line in lines)  # one INFO line each


def test_positional_model_and_short_parallel_forms():
    _, ea, _ = serve("some/model", "-tp", "2", "-dp", "3", "--enable-expert-parallel", "-q", "int8")
    assert (ea.model, ea.tensor_parallel_size, ea.data_parallel_size) == ("some/model", 2, 3)
    assert ea.enable_expert_parallel and ea.quantization == "int8"
    with pytest.raises(ValueError, match="the model is given twice"):
        serve("a", "--model", "b")


def test_scheduler_group():
    _, ea, lines = serve("--max-num-seqs", "8", "--max-num-batched-tokens", "4k", "--scheduling-policy", "priority",
                         "--enable-chunked-prefill", "--async-scheduling")
    assert (ea.max_num_seqs, ea.max_num_batched_tokens, ea.scheduling_policy) == (8, 4000, "priority")
    assert [line.split(":")[0] for line in lines] == ["--enable-chunked-prefill", "--async-scheduling"]


def test_cache_group():
    _, ea, _ = serve("--block-size", "32", "--kv-cache-dtype", "fp8", "--no-enable-prefix-caching",
                     "--num-gpu-blocks-override", "64", "--kv-cache-memory-bytes", "2G", "--max-model-len", "32K")
    assert (ea.block_size, ea.kv_cache_dtype, ea.enable_prefix_caching) == (32, "fp8", False)
    assert ea.num_kv_blocks == 64 and ea.kv_cache_memory_gb == 2.0  # 2G: binary, as vLLM reads it
    assert ea.max_model_len == 32768


def test_model_group():
    _, ea, lines = serve("--dtype", "half", "--seed", "3", "--generation-config", "vllm", "--enforce-eager",
                         "--tokenizer-mode", "deepseek_v4", "--chat-template", "{{ messages }}", "-O3",
                         "--disable-log-stats")
    assert (ea.dtype, ea.seed, ea.generation_config, ea.tokenizer_mode) == ("half", 3, "vllm", "deepseek_v4")
    assert ea.chat_template == "{{ messages }}"
    assert [line.split(":")[0] for line in lines] == ["--enforce-eager", "-O", "--disable-log-stats"]
    assert "captures no CUDA graphs" in lines[0]


def test_server_group():
    args, _, _ = serve("--host", "localhost", "--port", "9001", "--api-key", "k1", "k2", "--uvicorn-log-level", "info",
                       "--reasoning-parser", "deepseek_v4", "--tool-call-parser", "deepseek_v4",
                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                       "--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert (args.host, args.port, args.api_key, args.uvicorn_log_level) == ("localhost", 9001, ["k1", "k2"], "info")
    assert (args.reasoning_parser, args.tool_call_parser) == ("deepseek_v4", "deepseek_v4")
    assert '"ngram"' in args.speculative_config and "NixlConnector" in args.kv_transfer_config


def test_auto_tool_choice_needs_a_tool_parser():
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs a --tool-call-parser"):
        serve("--enable-auto-tool-choice", "--tool-call-parser", "none")


def test_issue_refusals(capsys):
    for argv, why in ((["--no-enable-chunked-prefill"], "always chunks"), (["-pp", "2"], "pipeline")):
        err = refused(capsys, *argv)
        assert f"supported by vLLM, not by openinfer: {argv[0]} (" in err and why in err


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_engine_flags_reach_generate_and_bench(capsys, command):
    """The other commands that take engine arguments get vLLM's engine flags from the same table."""
    argv = ["throughput"] if command == "bench" else []
    args = build_parser().parse_args([command, *argv, "--trust-remote-code", "-tp", "2",
                                      "--gpu-memory-utilization", "0.4"])
    assert args.tensor_parallel_size == 2 and args.gpu_memory_utilization == 0.4
    assert vllm_compat.log_noops(args)[0].startswith("--trust-remote-code")
    err = refused(capsys, *argv, "--enable-lora", command=command)
    assert "supported by vLLM, not by openinfer: --enable-lora" in err


def test_deepseek_v4_recipe_line_builds_its_config(tmp_path_factory):
    """vLLM's DeepSeek-V4 recipe line on the tiny V4 checkpoint the tests write: the config it builds (the real
    server runs it in test_vllm_serve_lines.py)."""
    from helpers import load_script

    ckpt = load_script("make_deepseek_v4_checkpoint").make_checkpoint(tmp_path_factory.mktemp("v4") / "tiny",
                                                                       "tiny", seed=0)
    args, ea, lines = serve(str(ckpt), "--trust-remote-code", "--kv-cache-dtype", "fp8", "--block-size", "256",
                            "--enable-expert-parallel", "--tokenizer-mode", "deepseek_v4", "--tool-call-parser",
                            "deepseek_v4", "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_v4")
    config = ea.create_engine_config()
    assert config.cache.block_size == 256 and config.cache.kv_cache_dtype == "fp8"
    assert config.parallel.enable_expert_parallel and config.tokenizer_mode == "deepseek_v4"
    assert len(lines) == 2


# -- values ---------------------------------------------------------------------------------------------------
def test_human_readable_int_is_vllms():
    assert [human_readable_int(v) for v in ("4096", "1k", "25.6k", "1K", "2M", "1g")] == [
        4096, 1000, 25600, 1024, 2 * 2**20, 10**9]
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int("1.5K")
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int("lots")


def test_gpu_memory_utilization_budget_is_vllms():
    """vLLM's meaning: the instance may use utilization x the device's whole memory; the KV cache gets that less
    what the instance already uses, and never more than is free."""
    from openinfer.worker.worker import kv_budget_for_utilization

    gib = 1 << 30
    assert kv_budget_for_utilization(80 * gib, 20 * gib, 60 * gib, 0.9) == 52 * gib
    assert kv_budget_for_utilization(80 * gib, 20 * gib, 30 * gib, 0.9) == 30 * gib  # another process holds memory
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2 leaves the KV cache no memory"):
        kv_budget_for_utilization(80 * gib, 20 * gib, 60 * gib, 0.2)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        from openinfer.config import CacheConfig

        CacheConfig(gpu_memory_utilization=1.5)


# -- LLM(...) and SamplingParams ------------------------------------------------------------------------------
def test_llm_keywords(caplog):
    caplog.set_level(logging.INFO, "openinfer")
    out = split_llm_kwargs({"trust_remote_code": True, "enforce_eager": True, "num_gpu_blocks_override": 64,
                            "kv_cache_memory_bytes": 1 << 30, "pipeline_parallel_size": 1, "enable_lora": False,
                            "max_num_seqs": 4, "gpu_memory_utilization": 0.5, "no_such_keyword": 1,
                            "limit_mm_per_prompt": {"image": 0}}, FIELDS)
    assert out == {"num_kv_blocks": 64, "kv_cache_memory_gb": 1.0, "max_num_seqs": 4, "gpu_memory_utilization": 0.5,
                   "no_such_keyword": 1, "limit_mm_per_prompt": {"image": 0}}  # unknown ones: EngineArgs names them
    assert "LLM(trust_remote_code=True): accepted for vLLM compatibility" in caplog.text
    for bad, why in (({"enable_lora": True}, "LoRA"), ({"pipeline_parallel_size": 2}, "pipeline"),
                     ({"enable_chunked_prefill": False}, "always chunks"), ({"hf_token": "t"}, "downloads nothing")):
        with pytest.raises(ValueError, match=f"supported by vLLM, not by openinfer: {next(iter(bad))}.*{why}"):
            split_llm_kwargs(bad, FIELDS)


def test_llm_refuses_before_loading_anything():
    from openinfer import LLM

    with pytest.raises(ValueError, match="supported by vLLM, not by openinfer: enable_lora"):
        LLM("/nonexistent", enable_lora=True)
    with pytest.raises(TypeError, match="'max_num_seq' .*did you mean 'max_num_seqs'"):
        LLM("/nonexistent", max_num_seq=2)


def test_llm_methods_vllm_has_and_openinfer_lacks():
    from openinfer import LLM

    llm = LLM.__new__(LLM)  # the refusals need no engine
    for name in ("embed", "encode", "classify", "score", "beam_search"):
        with pytest.raises(ValueError, match=f"supported by vLLM, not by openinfer: LLM.{name} "):
            getattr(llm, name)(["x"])
    with pytest.raises(ValueError, match="supported by vLLM, not by openinfer: lora_request"):
        llm.generate(["x"], lora_request=object())
    with pytest.raises(ValueError, match="supported by vLLM, not by openinfer: lora_request"):
        llm.chat([{"role": "user", "content": "x"}], lora_request=object())


def test_sampling_params_fields_vllm_has_and_openinfer_lacks():
    # vLLM's defaults ask for what openinfer does: accepted
    p = SamplingParams(detokenize=True, spaces_between_special_tokens=True, truncate_prompt_tokens=None,
                       best_of=None, flat_logprobs=False, temperature=0.5)
    assert p.temperature == 0.5
    # vLLM carries kv_transfer_params in extra_args
    assert SamplingParams(extra_args={"kv_transfer_params": {"do_remote_decode": True}}).kv_transfer_params == {
        "do_remote_decode": True}
    for kw in ({"detokenize": False}, {"truncate_prompt_tokens": 8}, {"logits_processors": [print]},
               {"best_of": 2}, {"extra_args": {"other": 1}}, {"spaces_between_special_tokens": False}):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=f"supported by vLLM, not by openinfer: SamplingParams.{name}="):
            SamplingParams(**kw)
    with pytest.raises(TypeError):  # not a vLLM field either: Python's own error
        SamplingParams(no_such_field=1)


def test_deepseek_v4_reasoning_parser_follows_the_thinking_mode():
    from openinfer.server.reasoning import make_reasoning_parser

    assert make_reasoning_parser("deepseek_v4", {}) is None  # chat mode: the prompt closed </think> already
    parser = make_reasoning_parser("deepseek_v4", {"thinking": True})  # the prompt ends inside <think>
    assert parser.feed("plan</think>answer") == ("plan", "answer")
    assert make_reasoning_parser("deepseek_v4", {"enable_thinking": True}) is not None


def test_the_docs_table_is_the_codes():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "vllm_compat.md").read_text()
    assert vllm_compat.markdown_table() in doc, "regenerate docs/vllm_compat.md's table (the command is there)"


def test_any_of_several_api_keys_is_accepted():
    """vLLM's --api-key takes several keys (rotation): any one of them opens the API, none other does."""
    import asyncio

    from openinfer.server.api import GuardMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def status(guard, token: str) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "path": "/v1/models", "headers": [(b"authorization", f"Bearer {token}".encode())]}
        asyncio.run(guard(scope, None, send))
        return sent[0]["status"]

    guard = GuardMiddleware(app, ["k1", "k2"], 1 << 20)
    assert [status(guard, t) for t in ("k1", "k2", "k3", "")] == [200, 200, 401, 401]
    assert [status(GuardMiddleware(app, "k1", 1 << 20), t) for t in ("k1", "k2")] == [200, 401]


def test_llm_chat_takes_vllms_template_kwargs_and_tools(tmp_path):
    """LLM.chat(chat_template_kwargs=..., tools=...) renders what the server renders for the same request."""
    from helpers import make_dense_checkpoint

    from openinfer import LLM
    from openinfer.chat_encoding.deepseek_v4 import encode_messages

    ckpt = make_dense_checkpoint(tmp_path / "m", "llama", max_position_embeddings=2048)
    llm = LLM(str(ckpt), dtype="float32", max_model_len=2048, num_kv_blocks=256, tokenizer_mode="deepseek_v4",
              kernel_backend="torch", trust_remote_code=True)
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    params = SamplingParams(max_tokens=1)
    tok = llm.get_tokenizer()
    thinking = llm.chat(msgs, params, use_tqdm=False, chat_template_kwargs={"thinking": True})[0]
    assert thinking.prompt_token_ids == tok.encode(encode_messages(msgs, thinking_mode="thinking"),
                                                   add_special_tokens=False)
    plain = llm.chat(msgs, params, use_tqdm=False)[0]
    assert plain.prompt_token_ids == tok.encode(encode_messages(msgs), add_special_tokens=False)
    assert thinking.prompt_token_ids != plain.prompt_token_ids
    with_tools = llm.chat(msgs, params, use_tqdm=False, tools=tools)[0]
    assert len(with_tools.prompt_token_ids) > len(plain.prompt_token_ids)  # the tools' schema is in the prompt
