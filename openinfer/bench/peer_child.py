"""The parent side's reading of a peer child's JSON result (vllm_peer.py, llamacpp_peer.py): both children write the
same shape, under their own schema name. Kept out of the peer modules' top level, which imports only the standard
library (each runs as a script in the peer's own interpreter)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_child_json(path: str | Path, schema: str, peer: str) -> dict[str, Any]:
    """The child's JSON, checked: ``engine`` (describe), ``environment``, ``sample`` (``IterationSample``
    fields, ``kv_context`` a pair or null), ``first_output_token_ids``, ``notes``."""
    d = json.loads(Path(path).read_text())
    if d.get("schema") != schema:
        raise ValueError(f"{path}: not a {peer} result (schema {d.get('schema')!r}, want {schema})")
    s = d["sample"]
    for key in ("elapsed_s", "num_output_tokens", "num_input_tokens"):
        if not isinstance(s.get(key), (int, float)):
            raise ValueError(f"{path}: sample.{key} missing or not a number")
    if s["elapsed_s"] <= 0:
        raise ValueError(f"{path}: non-positive elapsed_s {s['elapsed_s']}")
    if s.get("kv_context") is not None:
        s["kv_context"] = tuple(s["kv_context"])
    return d
