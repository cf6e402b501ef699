"""Where the embedded default model lives (shipped inside the package, created by
scripts/make_default_model.py)."""
from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "default-model"


def default_model_path() -> str:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise ValueError(f"the embedded default model is missing at {DEFAULT_MODEL_DIR}; "
                         "regenerate it with `python scripts/make_default_model.py`")
    return str(DEFAULT_MODEL_DIR)
