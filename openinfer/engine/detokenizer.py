"""Incremental detokenization and stop strings, once per request per step."""
from __future__ import annotations

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
        self.max_stop_len = max((len(s) for s in stop), default=0)

    def add(self, token_ids: list[int]) -> tuple[str | None, int]:
        """Append tokens; returns (the stop string if one now appears - text is then cut at it -, how many of
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
        if not self.stop:
            return None
        search_from = max(0, before - self.max_stop_len + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        return s

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: while running, hold back a suffix that could still grow into a stop string,
        so a stop string never leaks into streamed output."""
        if finished or not self.stop:
            return self.text
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return self.text[:len(self.text) - hold] if hold else self.text
