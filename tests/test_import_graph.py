"""Imports only point down. Read from the source with ``ast`` (nothing is imported or run): every ``import`` in a
package's files, lazy ones inside functions and ``TYPE_CHECKING`` blocks included, is checked against the layering

    entrypoints, server, bench  >  engine  >  executor  >  worker  >  models  >  layers  >  distributed  >  neutral

where the neutral modules (config, platform, forward_context, kv_cache_interface, step_io, sampling_params,
outputs, ...) are shared vocabulary that everyone may import and that import none of the packages above."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "openinfer"
PACKAGES = ("engine", "executor", "worker", "models", "layers", "server", "entrypoints", "bench")
NEUTRAL = ("config", "platform", "forward_context", "kv_cache_interface", "step_io", "sampling_params", "outputs",
           "kv_events", "envs", "gguf_file", "vllm_compat")

# (importing package, forbidden target): a target is a top-level package under openinfer/, or "torch".
FORBIDDEN = {
    "engine": {"torch", "worker", "models", "layers", "server", "entrypoints", "bench"},
    "executor": {"server", "entrypoints", "bench", "engine"},
    "worker": {"server", "entrypoints", "bench", "engine", "executor"},
    "models": {"engine", "worker", "executor", "server", "entrypoints", "bench"},
    "layers": {"engine", "worker", "executor", "server", "entrypoints", "bench", "models"},
}
FORBIDDEN.update({n: set(PACKAGES) for n in NEUTRAL})
# Process groups and collectives sit just above the neutral modules: layers use them, they use nothing above.
FORBIDDEN["distributed"] = set(PACKAGES)
# Grammar backends and matchers: the engine core uses them, so no torch and nothing above them (masks are bytes).
FORBIDDEN["structured_outputs"] = set(PACKAGES) | {"torch"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in one file, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(("openinfer",) + path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
            # ``from openinfer import platform`` imports the submodule openinfer.platform
            if mod == "openinfer":
                found += [(node.lineno, f"openinfer.{a.name}") for a in node.names]
    return found


def target(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "torch":
        return "torch"
    if parts[0] == "openinfer" and len(parts) > 1:
        return parts[1]
    return None


def owner(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def violations(files: list[Path]) -> list[str]:
    bad = []
    for f in files:
        forbidden = FORBIDDEN.get(owner(f), set())
        for line, mod in imported_modules(f):
            t = target(mod)
            if t in forbidden:
                bad.append(f"{f.relative_to(ROOT.parent)}:{line} ({owner(f)}) imports {mod}")
    return bad


def test_imports_point_down():
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) > 50
    assert violations(files) == []


@pytest.mark.parametrize("where, source, culprit", [
    ("engine/x.py", "import torch\n", "torch"),
    ("engine/x.py", "def f():\n    from openinfer.worker.worker import Worker\n", "openinfer.worker.worker"),
    ("engine/x.py", "from ..models import registry\n", "openinfer.models"),
    ("layers/x.py", "from openinfer.engine.request import Request\n", "openinfer.engine.request"),
    ("models/x.py", "from openinfer.executor import abstract\n", "openinfer.executor"),
    ("worker/x.py", "from openinfer.server.api import app\n", "openinfer.server.api"),
    ("forward_context.py", "from openinfer import engine\n", "openinfer.engine"),
    ("structured_outputs/x.py", "import torch\n", "torch"),
])
def test_the_checker_catches_upward_imports(tmp_path, monkeypatch, where, source, culprit):
    """The check above could pass vacuously if the parser saw nothing: each of these must be reported."""
    fake_root = tmp_path / "openinfer"
    f = fake_root / where
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(source)
    monkeypatch.setattr(__import__(__name__), "ROOT", fake_root)
    found = violations([f])
    assert len(found) == 1 and culprit in found[0], found
