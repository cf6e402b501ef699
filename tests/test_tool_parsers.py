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


# -- DeepSeek formats ----------------------------------------------------------------------------------

from openinfer.server.tool_parsers import (  # noqa: E402
    DeepSeekV3ToolParser,
    DeepSeekV4ToolParser,
    DeepSeekV32ToolParser,
)

D = "｜DSML｜"


def dsml(block: str, calls: list[tuple[str, list[tuple[str, str, str]]]]) -> str:
    invokes = "".join(f'<{D}invoke name="{n}">\n' + "".join(
        f'<{D}parameter name="{k}" string="{s}">{v}</{D}parameter>\n' for k, s, v in ps) + f"</{D}invoke>\n"
        for n, ps in calls)
    return f"<{D}{block}>\n{invokes}</{D}{block}>"


V4_CALLS = dsml("tool_calls", [("get_weather", [("city", "true", "Paris <north>"), ("days", "false", "3")]),
                               ("search", [("q", "true", "a\nb"), ("filters", "false", '{"x": [1, 2]}')])])
V3_CALLS = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n'
            '{"q": "x"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DEEPSEEK_CASES = [
    (DeepSeekV4ToolParser, "Let me look.\n\n" + V4_CALLS, "deepseek_v3"),
    (DeepSeekV4ToolParser, "<think>plan: call</think>\n\n" + V4_CALLS, "qwen3"),
    (DeepSeekV4ToolParser, "reasoning first</think>answer\n\n" + V4_CALLS[:-30], "deepseek_r1"),  # unclosed
    (DeepSeekV4ToolParser, f"broken <{D}tool_calls>\nnot an invoke\n</{D}tool_calls> tail", None),
    (DeepSeekV32ToolParser, "ok\n\n" + V4_CALLS.replace("tool_calls", "function_calls"), None),
    (DeepSeekV3ToolParser, "Sure." + V3_CALLS, None),
]


def run_with(parser_cls, text: str, cuts: list[int], reasoning: str | None):
    from openinfer.server.chat_tools import ChoiceParser, ToolPlan

    parser = ChoiceParser(parser_cls, ToolPlan(TOOLS, "auto"), reasoning)
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
        calls += [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in d.tool_calls]
    return reasoning_text, content, calls


@pytest.mark.parametrize("parser_cls, text, reasoning", DEEPSEEK_CASES)
def test_deepseek_formats_split_anywhere(parser_cls, text, reasoning):
    whole = run_with(parser_cls, text, [], reasoning)
    for cut in range(len(text) + 1):
        assert run_with(parser_cls, text, [cut], reasoning) == whole, cut
    rng = random.Random(7)
    for _ in range(100):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randrange(1, 10)))
        assert run_with(parser_cls, text, cuts, reasoning) == whole, cuts
    _, content, calls = whole
    if calls:  # no markup fragment in content
        assert "｜" not in content and "DSML" not in content and "▁" not in content, content


def test_deepseek_parse_results():
    assert run_with(DeepSeekV4ToolParser, *DEEPSEEK_CASES[0][1:2], [], "deepseek_v3")[1:] == ("", [])  # all thinking
    r, content, calls = run_with(DeepSeekV4ToolParser, DEEPSEEK_CASES[1][1], [], "qwen3")
    assert r == "plan: call" and content == ""
    assert calls == [("get_weather", {"city": "Paris <north>", "days": 3}),
                     ("search", {"q": "a\nb", "filters": {"x": [1, 2]}})]
    assert run_with(DeepSeekV4ToolParser, "Let me look.\n\n" + V4_CALLS, [], None)[1] == "Let me look."
    assert run_with(DeepSeekV4ToolParser, DEEPSEEK_CASES[2][1], [], "deepseek_r1")[2] == [
        ("get_weather", {"city": "Paris <north>", "days": 3})]  # the complete invoke of an unclosed block
    assert run_with(DeepSeekV4ToolParser, DEEPSEEK_CASES[3][1], [], None)[1] == DEEPSEEK_CASES[3][1]
    assert run_with(DeepSeekV32ToolParser, DEEPSEEK_CASES[4][1], [], None)[2][0][0] == "get_weather"
    assert run_with(DeepSeekV3ToolParser, DEEPSEEK_CASES[5][1], [], None) == (
        "", "Sure.", [("get_weather", {"city": "Paris"}), ("search", {"q": "x"})])


@pytest.mark.parametrize("parser_cls", [HermesToolParser, DeepSeekV4ToolParser, DeepSeekV32ToolParser,
                                        DeepSeekV3ToolParser])
def test_constrained_grammars_compile_and_accept_the_parsers_format(parser_cls):
    """The grammar that enforces required / named tool_choice accepts the format its parser reads (checked by
    llguidance on the text of a rendered call) and rejects a call to a tool not offered."""
    import llguidance

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}}]
    grammar = llguidance.grammar_from("lark", parser_cls.constrained_grammar(tools, None))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    if parser_cls is HermesToolParser:
        good = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","days":2}}\n</tool_call>'
    elif parser_cls is DeepSeekV3ToolParser:
        good = V3_CALLS.split("<｜tool▁call▁begin｜>function<｜tool▁sep｜>search")[0].replace(
            '{"city": "Paris"}', '{"city":"Oslo","days":2}') + "<｜tool▁calls▁end｜>"
    else:
        block = "tool_calls" if parser_cls is DeepSeekV4ToolParser else "function_calls"
        good = dsml(block, [("get_weather", [("city", "true", "Oslo"), ("days", "false", "2")])])
    assert parser_cls(tools).parse(good).tool_calls[0].name == "get_weather"
    assert _grammar_accepts(grammar, good)
    assert not _grammar_accepts(grammar, good.replace("get_weather", "get_time"))


def _grammar_accepts(grammar: str, text: str) -> bool:
    """Byte-level check with a byte tokenizer (token i = byte i)."""
    import llguidance

    class Bytes:
        eos_token_id = 256
        bos_token_id = None
        special_token_ids = [256]
        tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]

        def __call__(self, s):
            return list(s.encode())

    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    return m.consume_tokens(list(text.encode())) and m.is_accepting()
