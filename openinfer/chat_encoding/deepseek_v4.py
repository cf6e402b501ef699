"""DeepSeek-V4's chat encoding (the release's ``encoding/encoding_dsv4.py`` behaviour, written anew here).

A prompt is BOS, then each message: system text (with the tool list and response format appended), user turns
after ``<｜User｜>`` (tool results merged into the next user turn as ``<tool_result>`` blocks, in the order of
the calls they answer), ``<｜latest_reminder｜>`` notes, and assistant turns as ``[reasoning</think>]content
[\\n\\n<｜DSML｜tool_calls>...]<｜end▁of▁sentence｜>``. After the last user turn comes ``<｜Assistant｜>`` and
``<think>`` (thinking mode) or ``</think>`` (chat mode). In thinking mode earlier turns lose their reasoning
(and developer turns before the last user turn are dropped), unless the conversation has tools.
"""

from __future__ import annotations

import copy
import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
USER, ASSISTANT, REMINDER = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
TASK_TOKENS = {name: f"<｜{name}｜>" for name in ("action", "query", "authority", "domain", "title", "read_url")}
THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = (None, "high", "max")

EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

TOOLS_HEADER = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

"""
TOOLS_FOOTER = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[dict[str, Any]]) -> str:
    return TOOLS_HEADER + "\n".join(_json(t["function"]) for t in tools) + TOOLS_FOOTER


def _extras(msg: dict[str, Any]) -> str:
    """The tool list and the response format a system / developer message carries."""
    out = ""
    if msg.get("tools"):
        out += "\n\n" + render_tools(msg["tools"])
    if msg.get("response_format"):
        out += "\n\n" + RESPONSE_FORMAT + _json(msg["response_format"])
    return out


def render_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    invokes = []
    for call in tool_calls:
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except (TypeError, ValueError):
            args = {"arguments": fn["arguments"]}  # not JSON: passed on as one string parameter
        params = "\n".join(
            f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>" for k, v in args.items())
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n{params}\n</{DSML}invoke>')
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _merge_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool messages become tool_result blocks of a user turn; a user message right after them joins that turn."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        msg = copy.deepcopy(msg)
        role = msg.get("role")
        joinable = bool(out) and out[-1].get("role") == "user" and "blocks" in out[-1]
        if role == "tool":
            block = {"type": "tool_result", "id": msg.get("tool_call_id", ""), "content": msg.get("content", "")}
            if joinable:
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": msg.get("content", "")}
            if joinable and out[-1].get("task") is None:
                out[-1]["blocks"].append(block)
            else:
                out.append({"role": "user", "content": msg.get("content", ""), "blocks": [block],
                            **{k: msg[k] for k in ("task", "wo_eos") if k in msg}})
        else:
            out.append(msg)
    return out


def _order_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several results in one turn go in the order of the calls they answer (by tool_call_id)."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {c.get("id") or c.get("function", {}).get("id", ""): i for i, c in enumerate(msg["tool_calls"])}
            order.pop("", None)
        elif msg.get("role") == "user" and msg.get("blocks"):
            results = [b for b in msg["blocks"] if b["type"] == "tool_result"]
            if len(results) > 1 and order:
                ordered = iter(sorted(results, key=lambda b: order.get(b["id"], 0)))
                msg["blocks"] = [next(ordered) if b["type"] == "tool_result" else b for b in msg["blocks"]]
    return messages


def _last_user(messages: list[dict[str, Any]]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")), default=-1)


def _drop_old_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    last = _last_user(messages)
    out = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role in ("user", "system", "tool", "latest_reminder", "direct_search_results") or i >= last:
            out.append(msg)
        elif role == "assistant":
            out.append({k: v for k, v in msg.items() if k != "reasoning_content"})
        # other roles (developer) before the last user turn are left out
    return out


def _tool_result_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n\n".join(b.get("text", "") if b.get("type") == "text" else f"[Unsupported {b.get('type')}]"
                           for b in content)
    return content


def _render(i: int, msgs: list[dict[str, Any]], thinking: bool, drop: bool, effort: str | None) -> str:
    msg = msgs[i]
    role = msg.get("role")
    last_user = _last_user(msgs)
    out = EFFORT_MAX if i == 0 and thinking and effort == "max" else ""
    if role == "system":
        out += (msg.get("content") or "") + _extras(msg)
    elif role == "developer":
        if not msg.get("content"):
            raise ValueError(f"messages[{i}]: a developer message needs content")
        out += USER + msg["content"] + _extras(msg)
    elif role == "user":
        blocks = msg.get("blocks")
        if blocks:
            parts = [b["text"] if b["type"] == "text" else f"<tool_result>{_tool_result_text(b['content'])}</tool_result>"
                     for b in blocks]
            out += USER + "\n\n".join(parts)
        else:
            out += USER + (msg.get("content") or "")
    elif role == "latest_reminder":
        out += REMINDER + msg["content"]
    elif role == "assistant":
        reasoning = ""
        after_task = i > 0 and msgs[i - 1].get("task") is not None
        if thinking and not after_task and (not drop or i > last_user):
            reasoning = (msg.get("reasoning_content") or "") + THINK_END
        calls = render_tool_calls(msg["tool_calls"]) if msg.get("tool_calls") else ""
        out += reasoning + (msg.get("content") or "") + calls + ("" if msg.get("wo_eos") else EOS)
    else:
        raise ValueError(f"messages[{i}].role {role!r} is not supported by the deepseek_v4 encoding")
    if i + 1 < len(msgs) and msgs[i + 1].get("role") not in ("assistant", "latest_reminder"):
        return out  # the next turn is not the model's: no transition yet
    task = msg.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise ValueError(f"messages[{i}].task must be one of {sorted(TASK_TOKENS)}, got {task!r}")
        if task == "action":
            out += ASSISTANT + (THINK_START if thinking else THINK_END)
        out += TASK_TOKENS[task]
    elif role in ("user", "developer"):
        out += ASSISTANT + (THINK_START if thinking and (not drop or i >= last_user) else THINK_END)
    return out


def encode_messages(messages: list[dict[str, Any]], thinking_mode: str = "chat", drop_thinking: bool = True,
                    add_bos: bool = True, reasoning_effort: str | None = None) -> str:
    """The prompt text for ``messages`` (OpenAI-style; tools ride on a system / developer message)."""
    if thinking_mode not in THINKING_MODES:
        raise ValueError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of high, max (or unset), got {reasoning_effort!r}")
    msgs = _order_results(_merge_tool_results(messages))
    drop = drop_thinking and not any(m.get("tools") for m in msgs)  # tool use keeps every turn's reasoning
    thinking = thinking_mode == "thinking"
    if thinking and drop:
        msgs = _drop_old_reasoning(msgs)
    return (BOS if add_bos else "") + "".join(_render(i, msgs, thinking, drop, reasoning_effort)
                                             for i in range(len(msgs)))
