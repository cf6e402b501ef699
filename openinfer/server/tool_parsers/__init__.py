"""Tool-call parsers: each model family's tool-call text format, turned into OpenAI ``tool_calls``, as explicit
streaming state machines (the same calls and content whatever the chunk boundaries), and the grammar that
forces that format when ``tool_choice`` is ``required`` or names a function."""

from __future__ import annotations

from openinfer.server.tool_parsers.base import ParsedToolCall, ToolParser, ToolParserOutput
from openinfer.server.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV4ToolParser, DeepSeekV32ToolParser
from openinfer.server.tool_parsers.hermes import HermesToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v32": DeepSeekV32ToolParser,
    "deepseek_v4": DeepSeekV4ToolParser,
}

__all__ = ["TOOL_PARSERS", "HermesToolParser", "DeepSeekV3ToolParser", "DeepSeekV32ToolParser",
           "DeepSeekV4ToolParser", "ParsedToolCall", "ToolParser", "ToolParserOutput", "get_tool_parser"]


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser={name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}") from None
