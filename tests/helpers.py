"""Tiny checkpoints written by the tests themselves (HF format, random weights) and HF reference runs."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from openinfer.utils.char_tokenizer import CHAT_TEMPLATE, write_char_tokenizer  # noqa: F401 (re-exported)


def require_kernels():
    """The C++ kernels, for a test that needs them: a failed build raises (KernelBuildError, with the compiler's
    error), no toolchain fails the test; only OPENINFER_CPU_KERNELS=0 (the torch backend, asked for) skips."""
    import pytest

    from openinfer.layers import dispatch

    sel = dispatch.active()
    if sel.config.backend == "torch":
        pytest.skip("OPENINFER_CPU_KERNELS=0: the torch backend was asked for")
    assert sel.kernels, f"the CPU kernels are not built: {sel.build}"
    return sel.ops


def make_dense_checkpoint(path: str | Path, arch: str = "llama", seed: int = 0, vocab_size: int = 256,
                          tie: bool = False, **overrides) -> Path:
    """Write a tiny random fp32 Llama/Qwen2/Qwen3 checkpoint with tokenizer; returns the path."""
    import transformers

    path = Path(path)
    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-6)
    kw.update(overrides)
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    if arch == "qwen3":
        kw.setdefault("head_dim", 16)
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    with torch.no_grad():  # larger-than-init weights make logits spread, so greedy ties are unlikely
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "bias" in name:
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    write_char_tokenizer(path, vocab_size)
    return path


@torch.inference_mode()
def hf_greedy(path: str | Path, prompts: list[list[int]], max_new_tokens: int):
    """HF reference: greedy tokens and the logprob of each chosen token, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # No EOS: generation runs the full length without HF's min_new_tokens EOS suppression, which would
    # change the argmax (openinfer's ignore_eos keeps EOS sampleable, like vLLM).
    model.generation_config.eos_token_id = None
    results = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, return_dict_in_generate=True, pad_token_id=0)
        toks = out.sequences[0, len(ids):].tolist()
        full = torch.tensor([ids + toks])
        logits = model(full).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        lps = [float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(toks)]
        results.append((toks, lps))
    return results


def dense_state(model) -> dict[str, torch.Tensor]:
    """Every parameter, with each linear's weight and each experts module's stacked weights in their dense form
    (packed ones - FP8, MXFP4, low-bit - are empty placeholders among the parameters), in fp32."""
    from openinfer.layers.deepseek_moe import DeepseekExperts
    from openinfer.layers.linear import Linear

    state = dict(model.named_parameters())
    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            state[f"{name}.weight"] = mod.dense_weight().float()
        if isinstance(mod, DeepseekExperts):
            w13, w2 = mod.dense_weights()
            state[f"{name}.w13_weight"], state[f"{name}.w2_weight"] = w13.float(), w2.float()
    return state


def engine_model(llm):
    """The model inside an in-process engine (tests inspect weights and caches; the engine itself never does)."""
    return llm.engine.core.executor.driver_worker.model


def kv_manager(llm):
    """The engine core's KV cache manager (tests check pools and tables)."""
    return llm.engine.core.kv


def load_script(name: str):
    """A script under scripts/ as a module (the checkpoint generators are scripts, not package modules)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def random_prompts(seed: int, lengths: list[int], vocab_size: int = 256) -> list[list[int]]:
    """Seeded random prompts of the given lengths (ids from 6: clear of the char tokenizer's specials)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, vocab_size, (n,), generator=g).tolist() for n in lengths]


def peer_args(model, *extra: str):
    """``bench peers`` arguments as its parser makes them, the workload resolved (the peer runners' tests)."""
    import argparse

    from openinfer.bench import peers
    from openinfer.bench.workload import resolve_workload

    p = argparse.ArgumentParser()
    peers.add_args(p)
    args = p.parse_args(["--model", str(model), "--output-dir", "unused", *extra])
    resolve_workload(args)
    return args


# A local Ray instance must stay on loopback: ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import, and only
# with it 0 honours _node_ip_address (else the node, its actors and the executor's socket sit on the host's external
# address). tests/conftest.py sets it too, for a worker process that imported ray earlier.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def start_local_ray(temp_dir: str | Path, num_cpus: int = 4):
    """Start a Ray instance on 127.0.0.1 with this process as its head driver; returns the ray module. Other
    processes join it with ``RAY_ADDRESS=ray.get_runtime_context().gcs_address`` (and RAY_ENV). ray.shutdown()
    stops it."""
    import os

    import pytest

    os.environ.update(RAY_ENV)
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=str(temp_dir),
             log_to_driver=False)
    assert ray.util.get_node_ip_address() == "127.0.0.1", "the test Ray node must stay on loopback"
    return ray
