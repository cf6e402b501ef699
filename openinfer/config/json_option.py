"""The JSON-valued options (``--speculative-config``, ``--kv-transfer-config``) read into their dataclasses."""
from __future__ import annotations

import json
from dataclasses import fields


def parse_json_config(cls, value, name: str, required: tuple[str, ...]):
    """A JSON-valued config option (``--speculative-config``, ``--kv-transfer-config``): JSON text, a dict, an
    instance or None (``"null"`` too) -> the config; unknown keys and missing required ones are errors naming them."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be JSON, got {value!r}: {e}") from None
        if value is None:
            return None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; known: {sorted(known)}")
    missing = [k for k in required if k not in value]
    if missing:
        raise ValueError(f"{name} needs " + " and ".join(repr(k) for k in required))
    return cls(**value)
