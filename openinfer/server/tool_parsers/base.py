"""What every tool-call parser provides, and the tag scanning they share."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's ``function.arguments``


@dataclass
class ToolParserOutput:
    """What one ``feed`` / ``finish`` released: content text and completed tool calls."""

    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)

    def extend(self, other: ToolParserOutput) -> None:
        self.content += other.content
        self.tool_calls += other.tool_calls


class ToolParser(abc.ABC):
    """A streaming parser for one request's output. ``feed`` takes text in any pieces; ``finish`` flushes at the
    end. A tool call is released whole, once complete, so no fragment of its markup ever reaches ``content``;
    whitespace between calls is held back and dropped when the output has tool calls."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    @abc.abstractmethod
    def feed(self, text: str) -> ToolParserOutput: ...

    @abc.abstractmethod
    def finish(self) -> ToolParserOutput: ...

    def parse(self, text: str) -> ToolParserOutput:
        """The non-streaming result: the same machine, fed the whole text at once."""
        out = self.feed(text)
        out.extend(self.finish())
        return out

    @classmethod
    @abc.abstractmethod
    def constrained_grammar(cls, tools: list[dict[str, Any]], max_calls: int | None) -> str:
        """A Lark grammar (llguidance dialect) for output that is only tool calls of ``tools`` in this format:
        at least one, at most ``max_calls`` (None = any number)."""


def split_at_tag(buffer: str, tag: str) -> tuple[str, str | None, str]:
    """(text before the tag, the tag or None, the rest). Without a complete tag, the longest tail of ``buffer``
    that could still start the tag is held back as the rest, so a tag split across chunks is never released."""
    i = buffer.find(tag)
    if i >= 0:
        return buffer[:i], tag, buffer[i + len(tag):]
    for n in range(min(len(tag) - 1, len(buffer)), 0, -1):
        if tag.startswith(buffer[-n:]):
            return buffer[:-n], None, buffer[-n:]
    return buffer, None, ""


def function_schema(tool: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    fn = tool["function"]
    return fn["name"], fn.get("parameters") or {"type": "object"}
