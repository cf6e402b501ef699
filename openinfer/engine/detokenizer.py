"""Incremental detokenization and stop strings, once per request per step."""
from __future__ import annotations

from openinfer.engine.stop_strings import StopStringMatcher

# Prompt tokens kept as left context so the first generated token decodes with the right leading space.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop_str_in_output: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        # Only the new text is scanned, in time independent of the number of stop strings.
        self.matcher = StopStringMatcher(stop) if stop else None

    def add(self, token_ids: list[int]) -> tuple[str | None, int]:
        """Append tokens; returns (the stop string that now ends first - text is then cut at it -, how many of
        ``token_ids`` were taken). Several tokens in one step (speculative decoding) with stop strings go one at
        a time: the tokens after the one that completed a stop string are not part of the output."""
        if self.stop and len(token_ids) > 1:
            for i, t in enumerate(token_ids):
                hit, _ = self.add([t])
                if hit is not None:
                    return hit, i + 1
            return None, len(token_ids)
        return self._add(token_ids), len(token_ids)

    def _add(self, token_ids: list[int]) -> str | None:
        before = len(self.text)
        self.tokens.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = decode(self.tokens[self.prefix_offset:], skip_special_tokens=self.skip)
        # A trailing U+FFFD means a multi-byte character is incomplete: wait for the next token.
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
        if self.matcher is None:
            return None
        hit = self.matcher.feed(self.text[before:])
        if hit is None:
            return None
        end, stop = hit
        end += before
        self.text = self.text[:end] if self.include_stop else self.text[:end - len(stop)]
        return stop

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: while running, hold back a suffix that could still grow into a stop string,
        so a stop string never leaks into streamed output."""
        if finished or self.matcher is None:
            return self.text
        hold = self.matcher.pending
        return self.text[:len(self.text) - hold] if hold else self.text
