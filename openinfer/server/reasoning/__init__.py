"""Reasoning parsers: thinking models' ``<think> ... </think>`` split out of the answer into
``reasoning_content``, as a streaming state machine (the same split whatever the chunk boundaries)."""

from __future__ import annotations

from openinfer.server.tool_parsers.base import split_at_tag

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ThinkReasoningParser:
    """States: START (has the output opened a thinking block?), REASONING (until ``</think>``), ANSWER.
    ``starts_in_reasoning``: the chat template already opened the block in the prompt (DeepSeek-R1 / V3.1+
    thinking mode), so the output begins inside it."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.state = "reasoning" if starts_in_reasoning else "start"
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) text released by this piece."""
        self.buffer += text
        reasoning = answer = ""
        while True:
            if self.state == "start":
                stripped = self.buffer.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self.buffer = stripped[len(THINK_OPEN):]
                    self.state = "reasoning"
                elif THINK_OPEN.startswith(stripped):  # maybe still the tag: wait
                    return reasoning, answer
                else:
                    self.state = "answer"
            elif self.state == "reasoning":
                before, tag, rest = split_at_tag(self.buffer, THINK_CLOSE)
                reasoning += before
                self.buffer = rest
                if tag is None:
                    return reasoning, answer
                self.state = "answer"
            else:
                answer += self.buffer
                self.buffer = ""
                return reasoning, answer

    def finish(self) -> tuple[str, str]:
        text, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return text, ""
        return "", text


# name -> does the output start inside the thinking block? (None: as the request's chat_template_kwargs say)
REASONING_PARSERS = {"deepseek_r1": True, "deepseek_v3": True, "deepseek_v4": None, "qwen3": False, "think": False}


def make_reasoning_parser(name: str | None,
                          template_kwargs: dict | None = None) -> ThinkReasoningParser | None:
    """``deepseek_v4`` is vLLM's: DeepSeek-V4's prompt ends in ``<think>`` only in thinking mode
    (``chat_template_kwargs`` ``thinking`` or ``enable_thinking``), so the output is split there and passes whole
    otherwise (no reasoning_content)."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}")
    starts_inside = REASONING_PARSERS[name]
    if starts_inside is None:
        kw = template_kwargs or {}
        if not (kw.get("thinking") or kw.get("enable_thinking")):
            return None
        starts_inside = True
    return ThinkReasoningParser(starts_inside)
