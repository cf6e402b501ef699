"""Tool-call formats that wrap all of a turn's calls in one block (DeepSeek's DSML and V3 formats): content, then
``OPEN ... CLOSE``. States: CONTENT (text is content; trailing whitespace and a possible start of OPEN held
back) and IN_BLOCK (buffered until CLOSE, then parsed whole). A block that does not parse is content, verbatim;
an unclosed block at the end is parsed as far as it goes (a model may stop right after its last call)."""

from __future__ import annotations

import abc
import enum
from typing import Any

from openinfer.server.tool_parsers.base import ParsedToolCall, ToolParser, ToolParserOutput, split_at_tag


class _State(enum.Enum):
    CONTENT = 0
    IN_BLOCK = 1


class BlockToolParser(ToolParser):
    OPEN: str
    CLOSE: str

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.state = _State.CONTENT
        self.buffer = ""
        self.pending_ws = ""
        self.num_calls = 0

    @abc.abstractmethod
    def parse_block(self, body: str, closed: bool) -> list[ParsedToolCall] | None:
        """The calls in a block's body (between OPEN and CLOSE), or None when it is not a valid block."""

    def feed(self, text: str) -> ToolParserOutput:
        out = ToolParserOutput()
        self.buffer += text
        while True:
            if self.state is _State.CONTENT:
                before, tag, rest = split_at_tag(self.buffer, self.OPEN)
                self._content(before, out)
                self.buffer = rest
                if tag is None:
                    return out
                self.state = _State.IN_BLOCK
            else:
                body, tag, rest = split_at_tag(self.buffer, self.CLOSE)
                if tag is None:
                    return out
                self.buffer = rest
                self.state = _State.CONTENT
                self._block(body, True, out)

    def finish(self) -> ToolParserOutput:
        out = ToolParserOutput()
        if self.state is _State.IN_BLOCK:
            self._block(self.buffer, False, out)
        else:
            self._content(self.buffer, out)
        self.buffer = ""
        self.state = _State.CONTENT
        if not self.num_calls:
            out.content += self.pending_ws
        self.pending_ws = ""
        return out

    def _content(self, text: str, out: ToolParserOutput) -> None:
        body = text.rstrip()  # trailing whitespace may be the gap before a block: decided later
        if body:
            out.content += self.pending_ws + body
            self.pending_ws = text[len(body):]
        else:
            self.pending_ws += text

    def _block(self, body: str, closed: bool, out: ToolParserOutput) -> None:
        calls = self.parse_block(body, closed)
        if not calls:
            self._content(self.OPEN + body + (self.CLOSE if closed else ""), out)
            return
        out.tool_calls += calls
        self.num_calls += len(calls)
        self.pending_ws = ""
