"""Hermes / Qwen tool calls: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``, any number of them,
possibly after some content.

States: CONTENT (text is content; trailing whitespace held back; a possible start of ``<tool_call>`` held back) and
IN_CALL (text accumulates until ``</tool_call>``). A closed call whose body is not a JSON object with a string
``name`` is given back as content, verbatim, like any other text. At the end an unclosed call is parsed the same
way (models often stop right after the JSON)."""

from __future__ import annotations

import enum
import json
from typing import Any

from openinfer.server.tool_parsers.base import (
    ParsedToolCall,
    ToolParser,
    ToolParserOutput,
    function_schema,
    split_at_tag,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class _State(enum.Enum):
    CONTENT = 0
    IN_CALL = 1


class HermesToolParser(ToolParser):
    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.state = _State.CONTENT
        self.buffer = ""  # text not yet released (a partial tag, a call body)
        self.pending_ws = ""  # whitespace-only content held back
        self.num_calls = 0

    def feed(self, text: str) -> ToolParserOutput:
        out = ToolParserOutput()
        self.buffer += text
        while True:
            if self.state is _State.CONTENT:
                before, tag, rest = split_at_tag(self.buffer, OPEN)
                self._content(before, out)
                self.buffer = rest
                if tag is None:
                    return out
                self.state = _State.IN_CALL
            else:
                body, tag, rest = split_at_tag(self.buffer, CLOSE)
                if tag is None:
                    return out  # the whole body stays buffered until the call closes
                self.buffer = rest
                self.state = _State.CONTENT
                self._call(body, OPEN + body + CLOSE, out)

    def finish(self) -> ToolParserOutput:
        out = ToolParserOutput()
        if self.state is _State.IN_CALL:
            self._call(self.buffer, OPEN + self.buffer, out)
        else:
            self._content(self.buffer, out)
        self.buffer = ""
        self.state = _State.CONTENT
        if not self.num_calls:
            out.content += self.pending_ws
        self.pending_ws = ""
        return out

    def _content(self, text: str, out: ToolParserOutput) -> None:
        """Trailing whitespace is always held back: whether it is content or the gap before a tool call is only
        known later, and a chunk boundary must not decide it."""
        body = text.rstrip()
        if body:
            out.content += self.pending_ws + body
            self.pending_ws = text[len(body):]
        else:
            self.pending_ws += text

    def _call(self, body: str, raw: str, out: ToolParserOutput) -> None:
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            self._content(raw, out)
            return
        args = obj.get("arguments", obj.get("parameters", {}))
        out.tool_calls.append(ParsedToolCall(obj["name"], args if isinstance(args, str) else
                                             json.dumps(args, ensure_ascii=False)))
        self.num_calls += 1
        self.pending_ws = ""  # whitespace between calls is formatting, not content

    @classmethod
    def constrained_grammar(cls, tools: list[dict[str, Any]], max_calls: int | None) -> str:
        alts = []
        for i, tool in enumerate(tools):
            name, params = function_schema(tool)
            schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False,
                      "x-guidance": {"whitespace_flexible": False}}  # as for response_format's JSON
            alts.append(f"call_{i}: %json {json.dumps(schema)}")
        count = "+" if max_calls is None else ("" if max_calls == 1 else f"{{1,{max_calls}}}")
        calls = " | ".join(f"call_{i}" for i in range(len(tools)))
        return (f"start: call{count}\n"
                f'call: "{OPEN}\\n" ({calls}) "\\n{CLOSE}" "\\n"?\n' + "\n".join(alts))
