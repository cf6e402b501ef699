"""Tools on /v1/chat/completions: the ``tools`` and ``tool_choice`` checks (a 400 naming the field), the grammar
that enforces ``required`` and a named function, and the per-choice output parser (reasoning, then tool calls)
that streaming and non-streaming responses share."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from openinfer.sampling_params import StructuredOutputsParams
from openinfer.server.errors import APIError
from openinfer.server.reasoning import make_reasoning_parser
from openinfer.server.tool_parsers import ToolParser

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # validated, as the chat template gets them
    choice: str  # none | auto | required | named
    named: str | None = None
    constraint: StructuredOutputsParams | None = None


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict | None, parallel: bool | None,
                parser: type[ToolParser] | None) -> ToolPlan | None:
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs tools", 400, "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise APIError(f"tools must be a list of at most {MAX_TOOLS} entries", 400, "tools")
    names: set[str] = set()
    for i, t in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise APIError(f"{where}.type must be 'function'", 400, f"{where}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise APIError(f"{where}.function must be an object", 400, f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(f"{where}.function.name must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}", 400,
                           f"{where}.function.name")
        if name in names:
            raise APIError(f"{where}.function.name {name!r} is used by an earlier tool", 400,
                           f"{where}.function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise APIError(f"{where}.function.parameters must be a JSON schema of type object", 400,
                           f"{where}.function.parameters")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise APIError(f"{where}.function.description must be a string", 400, f"{where}.function.description")
    choice, named = _tool_choice(tool_choice, names)
    plan = ToolPlan(tools, choice, named)
    if choice in ("required", "named"):
        if parser is None:
            raise APIError("tool_choice 'required' or a named function needs a tool-call parser "
                           "(--tool-call-parser)", 400, "tool_choice")
        chosen = [t for t in tools if named is None or t["function"]["name"] == named]
        grammar = parser.constrained_grammar(chosen, 1 if (parallel is False or named) else None)
        plan.constraint = StructuredOutputsParams(grammar=grammar)
    return plan


def _tool_choice(tool_choice: str | dict | None, names: set[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(f"tool_choice must be none, auto, required or a function, got {tool_choice!r}", 400,
                           "tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError("tool_choice must be {'type': 'function', 'function': {'name': ...}}", 400, "tool_choice")
    if name not in names:
        raise APIError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(sorted(names))})",
                       400, "tool_choice.function.name")
    return "named", name


@dataclass
class ChoiceDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ChoiceParser:
    """One choice's text -> reasoning, content and OpenAI tool calls (ids made here, ``index`` counting per
    choice). Tool parsing only runs when the request has tools and tool_choice is not ``none``."""

    def __init__(self, tool_parser: type[ToolParser] | None, plan: ToolPlan | None, reasoning: str | None,
                 template_kwargs: dict | None = None) -> None:
        self.reasoning = make_reasoning_parser(reasoning, template_kwargs)
        self.tools = tool_parser(plan.tools) if tool_parser and plan and plan.choice != "none" else None
        self.num_calls = 0

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def feed(self, text: str) -> ChoiceDelta:
        return self._route(*(self.reasoning.feed(text) if self.reasoning else ("", text)), final=False)

    def finish(self) -> ChoiceDelta:
        reasoning, answer = self.reasoning.finish() if self.reasoning else ("", "")
        return self._route(reasoning, answer, final=True)

    def _route(self, reasoning: str, answer: str, final: bool) -> ChoiceDelta:
        out = ChoiceDelta(reasoning=reasoning)
        if self.tools is None:
            out.content = answer
            return out
        parsed = self.tools.feed(answer)
        if final:
            parsed.extend(self.tools.finish())
        out.content = parsed.content
        for call in parsed.tool_calls:
            out.tool_calls.append({"index": self.num_calls, "id": f"call_{uuid.uuid4().hex[:24]}",
                                   "type": "function",
                                   "function": {"name": call.name, "arguments": call.arguments}})
            self.num_calls += 1
        return out
