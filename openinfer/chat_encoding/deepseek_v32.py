"""DeepSeek-V3.2's chat encoding (the release's ``encoding/encoding_dsv32.py`` behaviour, written anew here).

Differences from V4: every user turn carries its own ``<｜Assistant｜>`` and ``<think>`` / ``</think>``; tool
results follow the assistant turn as ``<function_results><result>...</result></function_results>``; tool calls
sit in a ``<｜DSML｜function_calls>`` block; developer turns wrap tools and the user's message in a user turn.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from openinfer.chat_encoding.deepseek_v4 import BOS, DSML, EOS, THINK_END, THINK_START, _json

USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"

TOOLS_TEMPLATE = f"""## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of your reply to the user:
<{DSML}function_calls>
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
</{DSML}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:

<{DSML}function_calls>
...
</{DSML}function_calls>

<function_results>
...
</function_results>

{THINK_START}...thinking about results{THINK_END}

Here are the functions available in JSONSchema format:
<functions>
{{schemas}}
</functions>
"""
RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def _tools(tools: list[dict[str, Any]]) -> str:
    return TOOLS_TEMPLATE.replace("{schemas}", "\n".join(_json(t["function"]) for t in tools))


def _extras(msg: dict[str, Any]) -> str:
    out = "\n\n" + _tools(msg["tools"]) if msg.get("tools") else ""
    if msg.get("response_format"):
        out += "\n\n" + RESPONSE_FORMAT + _json(msg["response_format"])
    return out


def _tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    invokes = []
    for call in tool_calls:
        fn = call["function"]
        args = json.loads(fn["arguments"])
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>" for k, v in args.items())
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n{params}\n</{DSML}invoke>')
    return f"\n\n<{DSML}function_calls>\n" + "\n".join(invokes) + f"\n</{DSML}function_calls>"


def _last_user(messages: list[dict[str, Any]]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")), default=-1)


def _render(i: int, msgs: list[dict[str, Any]], thinking: bool) -> str:
    msg = msgs[i]
    role, content = msg.get("role"), msg.get("content")
    last_user = _last_user(msgs)
    transition = THINK_START if i == last_user and thinking else THINK_END
    if role == "system":
        return (content or "") + _extras(msg)
    if role in ("user", "developer"):
        if role == "developer":
            if not content:
                raise ValueError(f"messages[{i}]: a developer message needs content")
            content = _extras(msg) + f"\n\n# The user's message is: {content}"
        return USER + (content or "") + ASSISTANT + transition
    if role == "tool":
        j = i - 1
        while j >= 0 and msgs[j].get("role") == "tool":
            j -= 1
        calls = msgs[j].get("tool_calls") if j >= 0 and msgs[j].get("role") == "assistant" else None
        order = i - j  # 1-based position of this result among the assistant's calls
        if not calls or len(calls) < order:
            raise ValueError(f"messages[{i}]: a tool result needs the assistant tool call it answers before it")
        out = "\n\n<function_results>" if order == 1 else ""
        out += f"\n<result>{content}</result>"
        if order == len(calls):
            out += "\n</function_results>\n\n" + (THINK_START if i >= last_user and thinking else THINK_END)
        return out
    if role == "assistant":
        reasoning = ""
        if thinking and i > last_user:
            if not (msg.get("reasoning_content") or msg.get("tool_calls")):
                raise ValueError(f"messages[{i}]: in thinking mode an assistant turn after the last user turn "
                                 f"needs reasoning_content or tool_calls")
            reasoning = (msg.get("reasoning_content") or "") + THINK_END
        calls = _tool_calls(msg["tool_calls"]) if msg.get("tool_calls") else ""
        return reasoning + (content or "") + calls + EOS
    raise ValueError(f"messages[{i}].role {role!r} is not supported by the deepseek_v32 encoding")


def encode_messages(messages: list[dict[str, Any]], thinking_mode: str = "chat", drop_thinking: bool = True,
                    add_bos: bool = True) -> str:
    if thinking_mode not in ("chat", "thinking"):
        raise ValueError(f"thinking_mode must be one of ('chat', 'thinking'), got {thinking_mode!r}")
    msgs = messages
    thinking = thinking_mode == "thinking"
    if thinking and drop_thinking:  # earlier turns lose their reasoning; developer turns before the last user go
        last = _last_user(msgs)
        msgs = [m if m.get("role") in ("user", "system", "tool") or i >= last else
                {k: v for k, v in m.items() if k != "reasoning_content"}
                for i, m in enumerate(copy.copy(msgs)) if m.get("role") in ("user", "system", "tool", "assistant")
                or i >= last]
    return (BOS if add_bos else "") + "".join(_render(i, msgs, thinking) for i in range(len(msgs)))
