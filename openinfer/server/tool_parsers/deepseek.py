"""DeepSeek's tool-call formats.

DSML (V3.2 and V4)::

    <｜DSML｜tool_calls>                       (V3.2: function_calls)
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``string="true"`` values are taken as they are; others are JSON. V3 (and R1)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import json
import re
from typing import Any

from openinfer.server.tool_parsers.base import ParsedToolCall, function_schema
from openinfer.server.tool_parsers.block import BlockToolParser

DSML = "｜DSML｜"
_INVOKE = re.compile(r'<' + DSML + r'invoke name="([^"<>\n]+)">\n(.*?)</' + DSML + r'invoke>\n?', re.S)
_PARAM = re.compile(r'<' + DSML + r'parameter name="([^"<>\n]+)" string="(true|false)">(.*?)</' + DSML
                    + r'parameter>\n?', re.S)


def _args_json(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


class DeepSeekV4ToolParser(BlockToolParser):
    BLOCK = "tool_calls"
    OPEN = f"<{DSML}tool_calls>"
    CLOSE = f"</{DSML}tool_calls>"

    def parse_block(self, body: str, closed: bool) -> list[ParsedToolCall] | None:
        calls, pos = [], 0
        body = body.lstrip("\n")
        for m in _INVOKE.finditer(body):
            if body[pos:m.start()].strip():
                return None  # text between invokes: not a well-formed block
            args: dict[str, Any] = {}
            ppos = 0
            params = m.group(2)
            for p in _PARAM.finditer(params):
                if params[ppos:p.start()].strip():
                    return None
                name, is_string, raw = p.groups()
                if is_string == "true":
                    args[name] = raw
                else:
                    try:
                        args[name] = json.loads(raw)
                    except ValueError:
                        return None
                ppos = p.end()
            if params[ppos:].strip():
                return None
            calls.append(ParsedToolCall(m.group(1), _args_json(args)))
            pos = m.end()
        if body[pos:].strip() and closed:
            return None
        return calls or None

    @classmethod
    def constrained_grammar(cls, tools: list[dict[str, Any]], max_calls: int | None) -> str:
        """The block with one invoke per call; each tool's parameters in its schema's order, the required ones
        only (strings free text without '<', the rest JSON valid against the property's schema)."""
        rules, invokes = [], []
        for i, tool in enumerate(tools):
            name, params = function_schema(tool)
            props = params.get("properties", {})
            parts = []
            for j, key in enumerate(k for k in props if k in set(params.get("required", []))):
                sub = props[key]
                if sub.get("type") == "string" and not ({"enum", "const", "pattern", "format"} & set(sub)):
                    value = '/[^<]*/'
                    flag = "true"
                else:
                    rules.append(f"v_{i}_{j}: %json {json.dumps({**sub, 'x-guidance': {'whitespace_flexible': False}})}")
                    value, flag = f"v_{i}_{j}", "false"
                parts.append(f'"<{DSML}parameter name=\\"{key}\\" string=\\"{flag}\\">" {value} "</{DSML}parameter>\\n"')
            rules.append(f'invoke_{i}: "<{DSML}invoke name=\\"{name}\\">\\n" {" ".join(parts)} "</{DSML}invoke>\\n"')
            invokes.append(f"invoke_{i}")
        count = "+" if max_calls is None else ("" if max_calls == 1 else f"{{1,{max_calls}}}")
        return (f'start: "{cls.OPEN}\\n" invoke{count} "{cls.CLOSE}"\n'
                f"invoke: {' | '.join(invokes)}\n" + "\n".join(rules))


class DeepSeekV32ToolParser(DeepSeekV4ToolParser):
    OPEN = f"<{DSML}function_calls>"
    CLOSE = f"</{DSML}function_calls>"


_V3_CALL = re.compile(r"<｜tool▁call▁begin｜>function<｜tool▁sep｜>([^\n<]+)\n```json\n(.*?)\n```<｜tool▁call▁end｜>",
                      re.S)


class DeepSeekV3ToolParser(BlockToolParser):
    OPEN = "<｜tool▁calls▁begin｜>"
    CLOSE = "<｜tool▁calls▁end｜>"

    def parse_block(self, body: str, closed: bool) -> list[ParsedToolCall] | None:
        calls, pos = [], 0
        for m in _V3_CALL.finditer(body):
            if body[pos:m.start()].strip():
                return None
            try:
                args = json.loads(m.group(2))
            except ValueError:
                return None
            if not isinstance(args, dict):
                return None
            calls.append(ParsedToolCall(m.group(1).strip(), _args_json(args)))
            pos = m.end()
        if body[pos:].strip() and closed:
            return None
        return calls or None

    @classmethod
    def constrained_grammar(cls, tools: list[dict[str, Any]], max_calls: int | None) -> str:
        rules, alts = [], []
        for i, tool in enumerate(tools):
            name, params = function_schema(tool)
            rules.append(f"args_{i}: %json {json.dumps({**params, 'x-guidance': {'whitespace_flexible': False}})}")
            rules.append(f'call_{i}: "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\\n```json\\n" args_{i} '
                         f'"\\n```<｜tool▁call▁end｜>"')
            alts.append(f"call_{i}")
        count = "+" if max_calls is None else ("" if max_calls == 1 else f"{{1,{max_calls}}}")
        return (f'start: "{cls.OPEN}" call{count} "{cls.CLOSE}"\ncall: {" | ".join(alts)}\n' + "\n".join(rules))
