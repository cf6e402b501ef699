"""Tool-call and reasoning parsers: the streaming state machines give the same reasoning, content and tool calls
as the non-streaming parse wherever the text is split (every boundary, and random multi-way splits), and no
fragment of tool-call markup leaks into content."""
from __future__ import annotations

import json
import random

import pytest

from openinfer.server.chat_tools import ChoiceParser, ToolPlan
from openinfer.server.tool_parsers import HermesToolParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "<c>"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
OUTPUTS = [
    "plain answer, no tools < here > <tool",
    CALL,
    "Let me check.\n" + CALL + "\n" + CALL2,
    CALL + "\n\n" + CALL2 + "\n",
    "<think>the user wants weather</think>\n\n" + CALL,
    "<think>a < b and </thin is not a tag</think>Answer: <tool_call> not json </tool_call> tail",
    "text then an unclosed call " + CALL[:-len("</tool_call>")],  # the model stopped after the JSON
    "<think>never closed",
    "",
    "   ",
]


def run(text: str, cuts: list[int], reasoning: str | None) -> tuple[str, str, list]:
    parser = ChoiceParser(HermesToolParser, ToolPlan(TOOLS, "auto"), reasoning)
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    content = reasoning_text = ""
    calls = []
    for i, piece in enumerate(pieces):
        d = parser.feed(piece)
        if i == len(pieces) - 1:
            rest = parser.finish()
            d.content += rest.content
            d.reasoning += rest.reasoning
            d.tool_calls += rest.tool_calls
        content += d.content
        reasoning_text += d.reasoning
        calls += [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in d.tool_calls]
    return reasoning_text, content, calls


@pytest.mark.parametrize("reasoning", [None, "qwen3"])
@pytest.mark.parametrize("text", OUTPUTS)
def test_every_split_gives_the_non_streaming_result(text, reasoning):
    whole = run(text, [], reasoning)
    for cut in range(len(text) + 1):
        assert run(text, [cut], reasoning) == whole, cut
    rng = random.Random(len(text))
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(1, 12))))
        assert run(text, cuts, reasoning) == whole, cuts
    _, content, calls = whole
    if calls:
        assert "<tool_call>\n{" not in content and "</tool_call>" not in content.replace("not json </tool_call>", "")


def test_what_the_parse_finds():
    assert run(OUTPUTS[2], [], None) == ("", "Let me check.", [(0, "get_weather", {"city": "Paris", "unit": "<c>"}),
                                                               (1, "get_weather", {"city": "Oslo"})])
    assert run(OUTPUTS[4], [], "qwen3") == ("the user wants weather", "",
                                            [(0, "get_weather", {"city": "Paris", "unit": "<c>"})])
    # malformed calls stay content, verbatim; think tags without the reasoning parser are content too
    assert run(OUTPUTS[5], [], None)[1] == OUTPUTS[5]
    assert run(OUTPUTS[5], [], "qwen3")[1] == "Answer: <tool_call> not json </tool_call> tail"
    assert run(OUTPUTS[6], [], None)[2] == [(0, "get_weather", {"city": "Paris", "unit": "<c>"})]
    assert run(OUTPUTS[7], [], "deepseek_r1") == ("<think>never closed", "", [])  # starts inside the block
    assert run(OUTPUTS[7], [], "qwen3") == ("never closed", "", [])
    assert run("   ", [], None) == ("", "   ", [])
