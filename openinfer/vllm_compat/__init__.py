"""vLLM's ``vllm serve`` flags and ``LLM(...)`` keywords, each mapped once to what openinfer does with it.

One table (table.py), ``VLLM_FLAGS``, keyed by vLLM's long flag (vLLM's current names: ``vllm/engine/arg_utils.py``
and ``vllm/entrypoints/openai/cli_args.py``). Each entry is one of

- ``same``: openinfer has the setting under the same name with the same meaning (an ``EngineArgs`` field or a
  serve flag); the table adds vLLM's short forms (``-tp``) to it;
- ``alias``: openinfer has the capability under another name (``--num-gpu-blocks-override`` -> ``num_kv_blocks``);
- ``noop``: accepted, and one INFO line says why it changes nothing here (``--trust-remote-code``: openinfer runs
  no remote code);
- ``refuse``: "supported by vLLM, not by openinfer: --flag (why)", at parse time (exit 2) or as a ``ValueError``
  from ``LLM()``. Values listed in ``ok`` are what openinfer does anyway (``--pipeline-parallel-size 1``):
  those are accepted as a no-op.

``engine`` entries are also ``LLM()`` keywords (the flag's name in snake case); ``server`` entries exist only on
``openinfer serve``. The argparse of ``openinfer serve / generate / bench`` is generated from this table
(``add_vllm_flags``), and ``LLM()`` reads it through ``split_llm_kwargs``. Pure Python: a neutral module that
imports nothing of openinfer outside this package.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any

from openinfer.vllm_compat.flag import NOOPS_DEST, REFUSED, VllmFlag, human_readable_int
from openinfer.vllm_compat.table import LLM_KEYWORDS, TABLE, VLLM_FLAGS

__all__ = ["LLM_KEYWORDS", "NOOPS_DEST", "REFUSED", "TABLE", "VLLM_FLAGS", "VllmFlag", "add_vllm_flags",
           "human_readable_int", "log_noops", "markdown_table", "short_forms", "split_llm_kwargs"]

logger = logging.getLogger(__name__)


def short_forms(long_flag: str) -> tuple[str, ...]:
    """vLLM's short forms of a flag openinfer has under the same name (``--tensor-parallel-size`` -> ``-tp``)."""
    f = VLLM_FLAGS.get(long_flag)
    return f.short if f is not None and f.kind == "same" else ()


class _Noop(argparse.Action):
    """Accepts the flag (and its value, if it takes one); ``log_noops`` says why it changes nothing."""

    def __init__(self, option_strings, dest, flag: VllmFlag, **kw):
        self.flag = flag
        super().__init__(option_strings, dest=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        noted = getattr(namespace, NOOPS_DEST, None) or []
        noted.append((option_string, self.flag.why))
        setattr(namespace, NOOPS_DEST, noted)


class _Refuse(_Noop):
    """The flag is vLLM's and openinfer lacks what it asks for: exit 2 with the reason (a value in ``ok`` is
    openinfer's behaviour already: noted as a no-op instead)."""

    def __call__(self, parser, namespace, values, option_string=None):
        value = values[0] if isinstance(values, list) and values else values
        if self.flag.accepts(value):
            super().__call__(parser, namespace, values, option_string)
            return
        parser.error(REFUSED.format(flag=option_string, why=self.flag.why))


class _Alias(argparse.Action):
    def __init__(self, option_strings, dest, flag: VllmFlag, **kw):
        self.flag = flag
        super().__init__(option_strings, dest=flag.dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            setattr(namespace, self.dest, self.flag.convert(values))
        except (ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"{option_string}: {e}")


def add_vllm_flags(parser: argparse.ArgumentParser, scopes: tuple[str, ...] = ("engine",)) -> None:
    """Register every ``alias`` / ``noop`` / ``refuse`` entry of ``scopes`` the parser does not define itself
    (``same`` entries are the parser's own flags). Call after the parser's own flags are added."""
    group = parser.add_argument_group("vLLM compatibility", "vLLM's flags, accepted (a no-op, logged), mapped "
                                      "onto openinfer's, or refused by name: docs/vllm_compat.md")
    taken = parser._option_string_actions  # live: grows as flags are added
    for f in TABLE:
        if f.scope not in scopes or f.kind == "same" or f.name in taken:
            continue
        names = [n for n in (f.name, *f.short) if n not in taken]
        # refused flags stay out of --help (docs/vllm_compat.md lists them): they are there to be named in the error
        help_text = {"alias": f"vLLM's name of {f.why}", "noop": f"vLLM's; accepted, a no-op: {f.why}",
                     "refuse": argparse.SUPPRESS}[f.kind]
        if f.kind == "alias":
            group.add_argument(*names, action=_Alias, flag=f, help=help_text, metavar="VALUE")
            continue
        action = _Noop if f.kind == "noop" else _Refuse
        nargs = "?" if f.takes_value else 0
        group.add_argument(*names, action=action, flag=f, nargs=nargs, help=help_text,
                           **({"metavar": "VALUE"} if f.takes_value else {}))
        if f.negatable and "--no-" + f.name[2:] not in taken:
            group.add_argument("--no-" + f.name[2:], action=_Noop, nargs=0, help=argparse.SUPPRESS,
                               flag=VllmFlag(f.name, "noop", why="openinfer's behaviour already"))


def log_noops(args: argparse.Namespace) -> list[str]:
    """One INFO line per accepted no-op flag of this command line (returned too, for the tests)."""
    lines = [f"{flag}: accepted for vLLM compatibility, changes nothing here ({why})"
             for flag, why in getattr(args, NOOPS_DEST, None) or []]
    for line in lines:
        logger.info("%s", line)
    return lines


# -- LLM(...) -----------------------------------------------------------------------------------------------------

def split_llm_kwargs(kwargs: dict[str, Any], own_fields: set[str]) -> dict[str, Any]:
    """``LLM(**kwargs)`` as vLLM takes them -> openinfer's ``EngineArgs`` keywords: openinfer's own fields pass,
    vLLM's aliases are converted, no-ops are logged and dropped, refused ones raise ``ValueError`` by name (an
    unknown keyword passes on, for ``EngineArgs.from_kwargs`` to name with a hint)."""
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        f = LLM_KEYWORDS.get(key)
        negation = VLLM_FLAGS.get("--no-" + key.replace("_", "-"))
        if key in own_fields or f is None:
            out[key] = value
        elif value is False and negation is not None and negation.kind == "refuse":
            raise ValueError(REFUSED.format(flag=f"{key}=False", why=negation.why))
        elif f.kind == "alias":
            out[f.dest] = f.convert(value)
        elif f.kind == "noop" or (f.kind == "refuse" and (value is False or value is None
                                                          or f.accepts(value))):
            logger.info("LLM(%s=%r): accepted for vLLM compatibility, changes nothing here (%s)", key, value,
                        f.why or "openinfer's behaviour already")
        else:
            raise ValueError(REFUSED.format(flag=key, why=f.why))
    return out


def markdown_table() -> str:
    """The table as docs/vllm_compat.md shows it (the doc's test compares the two, so they cannot drift):
    ``python -c "from openinfer.vllm_compat import markdown_table; print(markdown_table())"``."""
    rows = ["| vLLM flag | `LLM()` keyword | openinfer |", "|---|---|---|"]
    for f in TABLE:
        names = ", ".join(f"`{n}`" for n in (f.name, *f.short))
        keyword = f"`{f.keyword}`" if f.scope == "engine" and not f.name.startswith("--no-") else "(serve only)"
        what = {"same": "the same setting",
                "alias": f"mapped: {f.why}",
                "noop": f"accepted, logged no-op: {f.why}",
                "refuse": f"refused: {f.why}" + (f" (accepted: {', '.join(f.ok)})" if f.ok else "")}[f.kind]
        rows.append(f"| {names} | {keyword} | {what} |")
    return "\n".join(rows)
