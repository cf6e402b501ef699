"""The model contract (models/interface.py) is checked, not assumed: every registered architecture and MTP class
satisfies it, the registry rejects a class that does not (naming it and what is wrong), capabilities are read as
typed class attributes, and nothing outside ``openinfer/models`` names a concrete model class or probes one."""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import make_dense_checkpoint

from openinfer.config import ParallelConfig
from openinfer.engine_args import EngineArgs
from openinfer.models import registry
from openinfer.models.interface import (CausalLM, DSparkTarget, MTPLayer, ParallelMode, check_model_class,
                                        check_mtp_class)
from openinfer.models.llama import LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent / "openinfer"


@pytest.mark.parametrize("arch", registry.supported_architectures())
def test_every_registered_architecture_satisfies_the_contract(arch):
    cls = registry.resolve_model_class(arch)
    assert issubclass(cls, CausalLM) and not cls.__abstractmethods__
    assert check_model_class(cls) is cls
    assert isinstance(cls.supported_quantization, tuple) and isinstance(cls.supported_kv_cache_dtypes, tuple)
    assert "auto" in cls.supported_kv_cache_dtypes
    assert ParallelMode.DATA in cls.supported_parallel_modes
    assert registry.uses_dspark(arch) == cls.drafts_with_dspark == issubclass(cls, DSparkTarget)
    mtp = cls.mtp_layer_class()
    if mtp is not None:
        assert registry.resolve_mtp_class(arch) is check_mtp_class(mtp) is mtp
        assert issubclass(mtp, MTPLayer) and not mtp.__abstractmethods__


def test_mtp_architectures():
    assert registry.mtp_architectures() == ["DeepseekV3ForCausalLM", "DeepseekV41ForCausalLM",
                                            "DeepseekV4ForCausalLM"]
    assert registry.resolve_mtp_class("DeepseekV4ForCausalLM").shares_target
    assert not registry.resolve_mtp_class("DeepseekV3ForCausalLM").shares_target
    with pytest.raises(ValueError, match="'mtp' is not available for 'LlamaForCausalLM'; MTP layers are supported "
                                         "for DeepseekV3ForCausalLM, DeepseekV41ForCausalLM, DeepseekV4ForCausalLM"):
        registry.resolve_mtp_class("LlamaForCausalLM")


@pytest.fixture
def fake_module(monkeypatch):
    """A module the registry can import classes from; architectures registered through it are removed after."""
    mod = types.ModuleType("contract_fakes")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    before = dict(registry._MODELS)
    yield mod
    registry._MODELS.clear()
    registry._MODELS.update(before)


def _register(mod, cls) -> str:
    setattr(mod, cls.__name__, cls)
    registry.register_model(cls.__name__, mod.__name__, cls.__name__)
    return cls.__name__


def test_registry_rejects_a_class_that_does_not_inherit_the_contract(fake_module):
    class PlainModule(torch.nn.Module):
        def forward(self, input_ids, positions):
            return input_ids

    arch = _register(fake_module, PlainModule)
    with pytest.raises(TypeError, match=r"model class .*PlainModule does not satisfy the model "
                                        r"contract .*does not inherit openinfer.models.interface.CausalLM"):
        registry.resolve_model_class(arch)


def test_registry_rejects_missing_methods(fake_module):
    class HalfModel(CausalLM):
        def forward(self, input_ids, positions):
            return input_ids

        def compute_logits(self, hidden):
            return hidden

    arch = _register(fake_module, HalfModel)
    with pytest.raises(TypeError, match=r"HalfModel does not satisfy the model contract .*missing method\(s\) "
                                        r"bind_kv_cache, free_kv_cache, kv_cache_spec, load_weights"):
        registry.resolve_model_class(arch)


def test_registry_rejects_mistyped_capabilities(fake_module):
    class Mistyped(LlamaForCausalLM):
        supported_quantization = "int8"  # a str, not a tuple of them
        supported_parallel_modes = frozenset({"tensor"})  # names, not ParallelMode
        drafts_with_dspark = 1

    arch = _register(fake_module, Mistyped)
    with pytest.raises(TypeError) as e:
        registry.resolve_model_class(arch)
    msg = str(e.value)
    assert "Mistyped does not satisfy the model contract" in msg
    assert "supported_quantization must be a tuple of str, got 'int8'" in msg
    assert "supported_parallel_modes must be a frozenset of ParallelMode" in msg
    assert "drafts_with_dspark must be a bool, got 1" in msg


def test_dspark_flag_needs_the_dspark_methods(fake_module):
    class FakeDSpark(LlamaForCausalLM):
        drafts_with_dspark = True

    arch = _register(fake_module, FakeDSpark)
    with pytest.raises(TypeError, match="drafts_with_dspark is set but it does not inherit DSparkTarget"):
        registry.resolve_model_class(arch)


def test_registry_rejects_a_bad_mtp_class(fake_module):
    class NoLoader(MTPLayer):  # builds its own weights (shares_target False) but cannot load them
        def forward(self, input_ids, positions, hidden):
            return hidden

        def compute_logits(self, hidden):
            return hidden

        def kv_cache_spec(self, block_size, dtype):
            return []

        def bind_kv_cache(self, num_blocks, block_size, dtype, device):
            pass

        def free_kv_cache(self):
            pass

    class WithBadMtp(LlamaForCausalLM):
        @classmethod
        def mtp_layer_class(cls):
            return NoLoader

    arch = _register(fake_module, WithBadMtp)
    with pytest.raises(TypeError, match=r"MTP layer class .*NoLoader does not satisfy the model contract .*missing "
                                        r"method load_weights \(required unless shares_target\)"):
        registry.resolve_mtp_class(arch)
    check_mtp_class(type("Shared", (NoLoader,), {"shares_target": True}))  # a shared layer loads nothing
    with pytest.raises(TypeError, match="does not inherit openinfer.models.interface.MTPLayer"):
        check_mtp_class(LlamaForCausalLM)


def test_registry_names_a_missing_class(fake_module):
    registry.register_model("GhostForCausalLM", fake_module.__name__, "Ghost")
    with pytest.raises(TypeError, match=r"'GhostForCausalLM' is registered as contract_fakes.Ghost, which does "
                                        r"not exist"):
        registry.resolve_model_class("GhostForCausalLM")


def test_parallel_modes_are_checked_against_the_class(fake_module, tmp_path):
    class DataOnly(LlamaForCausalLM):
        supported_parallel_modes = CausalLM.supported_parallel_modes  # the default: whole replicas only

    arch = _register(fake_module, DataOnly)
    registry.check_parallel(arch, ParallelConfig(data_parallel_size=2))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: DataOnly does not support tensor parallelism; "
                                         r"it supports data"):
        registry.check_parallel(arch, ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="enable_expert_parallel: DataOnly does not support expert parallelism"):
        registry.check_parallel(arch, ParallelConfig(data_parallel_size=2, enable_expert_parallel=True))
    # ... and at start-up, from EngineArgs
    import json

    path = make_dense_checkpoint(tmp_path / "m", vocab_size=64)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
    with pytest.raises(ValueError, match="tensor_parallel_size=2: DataOnly does not support tensor parallelism"):
        EngineArgs(model=str(path), device="meta", tensor_parallel_size=2).create_engine_config()
    assert EngineArgs(model=str(path), device="meta", data_parallel_size=2).create_engine_config()


def test_builtin_parallel_modes():
    every = frozenset(ParallelMode)
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM",
                 "DeepseekV4ForCausalLM"):
        assert registry.resolve_model_class(arch).supported_parallel_modes == every
    # V4.1 loads unsharded (no tensor parallelism); its experts split over expert-parallel replicas
    v41 = "DeepseekV41ForCausalLM"
    assert registry.resolve_model_class(v41).supported_parallel_modes == {ParallelMode.DATA, ParallelMode.EXPERT}
    registry.check_parallel(v41, ParallelConfig(data_parallel_size=2, enable_expert_parallel=True))
    with pytest.raises(ValueError, match="tensor_parallel_size=2: DeepseekV41ForCausalLM does not support tensor "
                                         "parallelism; it supports data, expert"):
        registry.check_parallel(v41, ParallelConfig(tensor_parallel_size=2))


def _sources_outside_models():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] != "models":
            yield rel, path.read_text()


def test_nothing_outside_models_names_a_model_class():
    """Model classes (and their per-layer caches) are the models package's business: elsewhere they are reached
    through the registry and the contract."""
    names = set()
    for arch in registry.supported_architectures():
        cls = registry.resolve_model_class(arch)
        names |= {c.__name__ for c in cls.__mro__ if c.__module__.startswith("openinfer.models.")
                  and c.__module__ != "openinfer.models.interface"}
        mtp = cls.mtp_layer_class()
        if mtp is not None:
            names.add(mtp.__name__)
    names |= {"V4LayerCache", "LayerCache", "DeepseekV41Model", "DeepseekV4Model", "DeepseekV3Model"}
    pattern = re.compile(r"\b(" + "|".join(sorted(names)) + r")\b")
    found = []
    for rel, text in _sources_outside_models():
        for i, line in enumerate(text.splitlines(), 1):
            if pattern.search(line) or re.search(r"openinfer\.models\.(deepseek|llama)", line):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_no_capability_probes_outside_models():
    probes = re.compile(r"(getattr|hasattr)\([^)]*[\"'](supported_\w+|shares_target|mtp|cache|drafts_with_dspark|"
                        r"ids_store|mtp_layer_class)[\"']")
    found = [f"{rel}:{i}: {line.strip()}" for rel, text in _sources_outside_models()
             for i, line in enumerate(text.splitlines(), 1) if probes.search(line)]
    assert not found, "\n".join(found)
