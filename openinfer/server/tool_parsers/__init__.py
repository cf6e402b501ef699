"""Tool-call parsers: each model family's tool-call text format, turned into OpenAI ``tool_calls``, as explicit
streaming state machines (the same calls and content whatever the chunk boundaries), and the grammar that
forces that format when ``tool_choice`` is ``required`` or names a function."""

from __future__ import annotations

from openinfer.server.tool_parsers.base import ParsedToolCall, ToolParser, ToolParserOutput
from openinfer.server.tool_parsers.hermes import HermesToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "qwen": HermesToolParser}

__all__ = ["TOOL_PARSERS", "ParsedToolCall", "ToolParser", "ToolParserOutput", "get_tool_parser"]


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser={name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}") from None
