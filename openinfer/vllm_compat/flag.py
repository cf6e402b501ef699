"""One vLLM flag's entry in the compatibility table, and the value parsers vLLM's flags use."""
from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REFUSED = "supported by vLLM, not by openinfer: {flag} ({why})"
NOOPS_DEST = "_vllm_noops"  # where the no-op actions record what they accepted, for log_noops


def human_readable_int(value: str) -> int:
    """vLLM's integer parser for lengths: '32k' = 32,000, '32K' = 32,768 (binary suffixes take whole numbers)."""
    text = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if m is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer (e.g. 4096, 32k, 32K)") from None
    number, suffix = m.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"{value!r}: a binary suffix (K, M, G, T) takes a whole number")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


def bytes_to_gib(value: str | int) -> float:
    n = human_readable_int(value) if isinstance(value, str) else int(value)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"kv_cache_memory_bytes must be > 0, got {value!r}")
    return n / (1 << 30)


@dataclass(frozen=True)
class VllmFlag:
    name: str  # vLLM's long flag
    kind: str  # same | alias | noop | refuse
    scope: str = "engine"  # engine (also an LLM() keyword) | server (openinfer serve only)
    why: str = ""  # noop: the log line's reason; refuse: the error's
    short: tuple[str, ...] = ()  # vLLM's short forms
    dest: str | None = None  # alias: the openinfer setting it sets
    convert: Callable[[Any], Any] | None = None  # alias: vLLM's value -> openinfer's
    takes_value: bool = True  # noop / refuse: whether the flag reads a value
    negatable: bool = False  # vLLM's --x / --no-x pair: --no-x is openinfer's behaviour already (a no-op)
    ok: tuple[str, ...] = ()  # refuse: values that are openinfer's behaviour already (accepted as a no-op)

    @property
    def keyword(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    def accepts(self, value: Any) -> bool:
        """A refused flag's value that asks for openinfer's behaviour anyway: one listed in ``ok``, or (for a
        per-modality limit such as ``--limit-mm-per-prompt '{"image": 0}'``) zero items of everything."""
        if value is None or isinstance(value, list):
            return False
        if str(value) in self.ok:
            return True
        if self.name == "--limit-mm-per-prompt":
            try:
                limits = json.loads(value) if isinstance(value, str) else value
            except ValueError:
                return False
            return isinstance(limits, dict) and all(v == 0 for v in limits.values())
        return False


def same(name: str, scope: str = "engine", short: tuple[str, ...] = ()) -> VllmFlag:
    return VllmFlag(name, "same", scope, short=short)


def alias(name: str, dest: str, convert: Callable[[Any], Any], why: str, scope: str = "engine") -> VllmFlag:
    return VllmFlag(name, "alias", scope, why=why, dest=dest, convert=convert)


def noop(name: str, why: str, scope: str = "engine", takes_value: bool = False, negatable: bool = False,
         short: tuple[str, ...] = ()) -> VllmFlag:
    return VllmFlag(name, "noop", scope, why=why, takes_value=takes_value, negatable=negatable, short=short)


def refuse(name: str, why: str, scope: str = "engine", takes_value: bool = True, negatable: bool = False,
           ok: tuple[str, ...] = (), short: tuple[str, ...] = ()) -> VllmFlag:
    return VllmFlag(name, "refuse", scope, why=why, takes_value=takes_value, negatable=negatable, ok=ok,
                    short=short)

