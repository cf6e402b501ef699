"""DeepInfer 0.1.0's own pure-torch reference functions (``*_ref``) and ``hugging_face/names.py`` as test oracles.

DeepInfer is V4.1-Flash's only definition; openinfer was written from a reading of it, so a test that compares
openinfer with a reference openinfer wrote can pass on a shared misreading. These oracles are DeepInfer's code.
Their modules import CUDA-only packages (tilelang, deep_gemm, DeepInfer's compiled ops), so nothing of DeepInfer is
imported: each wanted function is taken out of the module's source with ``ast``, together with the module-level
names it reads (helpers, constants, plain imports of torch / math / re ...), and executed in a fresh namespace.
Nothing is copied into the project.

Source, first found wins:
1. the shared copy next to the checkout (``../shared/reference/deepinfer-0.1.0``),
2. the PyPI sdist, pinned by URL and sha256, downloaded once into ``~/.cache/openinfer/`` (``pip download``
   cannot fetch it: it builds the sdist's metadata, and its setup.py needs CUDA),
3. neither: ``pytest.skip`` with one line naming what is missing.
"""
from __future__ import annotations

import ast
import hashlib
import io
import os
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

VERSION = "0.1.0"
SDIST_URL = ("https://files.pythonhosted.org/packages/bd/56/e209143eb913dd4c1f57abd4868eaae7a53e15a92a42a2aca68e43"
             "2499d5/deepinfer-0.1.0.tar.gz")
SDIST_SHA256 = "959b9bd010893b4c6dc60be0dd822e10e7f1ae1e53289233a83741f76c3d681a"
SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / f"deepinfer-{VERSION}"
CACHE = Path.home() / ".cache" / "openinfer" / f"deepinfer-{VERSION}"
OPS = "deepinfer/model_executor/layers/tilelang_ops"
# Imports an extracted function may need; anything else (deepinfer, tilelang, deep_gemm, pytest) is refused.
PLAIN_MODULES = {"torch", "math", "re", "typing", "collections", "dataclasses", "functools", "itertools", "numpy",
                 "json", "pathlib", "__future__"}

_root: Path | None = None


def source_root() -> Path:
    """The unpacked DeepInfer sdist, or skip the calling test."""
    global _root
    if _root is not None:
        return _root
    for candidate in (SHARED, CACHE):
        if (candidate / "deepinfer").is_dir():
            _root = candidate
            return _root
    try:
        with urllib.request.urlopen(SDIST_URL, timeout=60) as r:
            blob = r.read()
    except OSError as e:
        pytest.skip(f"DeepInfer {VERSION} oracles: no {SHARED} and the PyPI sdist could not be fetched ({e})")
    digest = hashlib.sha256(blob).hexdigest()
    if digest != SDIST_SHA256:
        pytest.skip(f"DeepInfer {VERSION} oracles: sdist sha256 {digest} != pinned {SDIST_SHA256}")
    # Unpacked beside the cache and renamed into place: parallel test workers never see half a tree.
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE.parent) as tmp:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
            tar.extractall(tmp, filter="data")
        try:
            os.rename(Path(tmp) / f"deepinfer-{VERSION}", CACHE)
        except OSError:
            if not (CACHE / "deepinfer").is_dir():  # not another worker's finished copy
                raise
    _root = CACHE
    return _root


def _strip_annotations(fn: ast.FunctionDef) -> None:
    """Annotations are evaluated at ``def`` time and may name DeepInfer types; the oracles do not need them."""
    fn.returns = None
    a = fn.args
    for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
        if arg is not None:
            arg.annotation = None


def _top_level(tree: ast.Module) -> dict[str, ast.stmt]:
    defs: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        defs[n.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defs[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                defs[(alias.asname or alias.name).split(".")[0]] = node
    return defs


def _needed(node: ast.stmt, defs: dict[str, ast.stmt], path: str) -> list[ast.stmt]:
    """``node`` and the module-level statements it reads, dependencies first."""
    order: list[ast.stmt] = []
    seen: set[int] = set()

    def visit(stmt: ast.stmt) -> None:
        if id(stmt) in seen:
            return
        seen.add(id(stmt))
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            module = stmt.module if isinstance(stmt, ast.ImportFrom) else stmt.names[0].name
            if (module or "").split(".")[0] not in PLAIN_MODULES:
                raise RuntimeError(f"{path}: the oracle needs {ast.unparse(stmt)!r}, which is not plain torch")
        if isinstance(stmt, ast.FunctionDef):
            for d in stmt.decorator_list:
                if "pytest" in ast.unparse(d):
                    raise RuntimeError(f"{path}: {stmt.name} is a test, not an oracle")
            _strip_annotations(stmt)
        for n in ast.walk(stmt):
            if isinstance(n, ast.Name) and n.id in defs and defs[n.id] is not stmt:
                visit(defs[n.id])
        order.append(stmt)

    visit(node)
    return order


def load(relpath: str, *names: str, provide: dict | None = None) -> SimpleNamespace:
    """Functions (or classes, module constants) ``names`` of DeepInfer module ``relpath`` (relative to the sdist root),
    runnable on CPU torch. ``provide``: names the module imports from DeepInfer itself, given by the caller (each
    also an oracle, e.g. ``AttrDict`` loaded from deepinfer/attrdict.py)."""
    path = source_root() / relpath
    tree = ast.parse(path.read_text(), str(path))
    defs = {k: v for k, v in _top_level(tree).items() if k not in (provide or {})}
    body: list[ast.stmt] = []
    for name in names:
        if not isinstance(defs.get(name), (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)):
            raise RuntimeError(f"{relpath} defines no function, class or constant {name!r} (DeepInfer {VERSION})")
        for stmt in _needed(defs[name], defs, relpath):
            if stmt not in body:
                body.append(stmt)
    namespace: dict = {"__name__": f"deepinfer_oracle:{relpath}", **(provide or {})}
    # dont_inherit: this file's ``from __future__ import annotations`` would turn a DeepInfer dataclass's field
    # types into strings, which dataclasses resolve through sys.modules (where the oracle namespace is not).
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec", dont_inherit=True), namespace)
    return SimpleNamespace(**{n: namespace[n] for n in names})


def op(module: str, *names: str) -> SimpleNamespace:
    """``*_ref`` functions of ``tilelang_ops/<module>.py``."""
    return load(f"{OPS}/{module}.py", *names)


def names_module() -> SimpleNamespace:
    """DeepInfer's ``hugging_face/names.py`` (plain Python: re and typing only)."""
    return load("deepinfer/hugging_face/names.py", "hf_to_model", "scale_name", "_HF_TO_MODEL_SUFFIX",
                "_HF_TO_EMBED_SUFFIX", "_HF_TO_HEAD_SUFFIX", "_HF_TO_MTP_EXTRA")
