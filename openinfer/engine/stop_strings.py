"""Stop strings as one Aho-Corasick automaton: the text is fed once, character by character, and each step costs
O(1) amortised however many stop strings a request has (a ``find`` per stop string per token made one request
with a long stop list slow the engine thread for every request).

The automaton's state after the text read so far is the longest suffix of that text which is still the start of
some stop string, so its depth is also exactly how much text must be held back from streaming (it may still grow
into a stop string).
"""
from __future__ import annotations

from collections import deque


class StopStringMatcher:
    def __init__(self, stop: list[str]) -> None:
        self.stop = list(stop)
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        own: list[int | None] = [None]  # the stop string (index) that ends exactly at this node
        for idx, s in enumerate(self.stop):
            node = 0
            for ch in s:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    own.append(None)
                node = nxt
            if own[node] is None:  # duplicates: the first one names the match
                own[node] = idx
        fail = [0] * len(goto)
        # match[n]: the longest stop string that is a suffix of node n's text (its own, else its fail node's).
        match = list(own)
        queue = deque(goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0) if goto[f].get(ch, 0) != child else 0
                if match[child] is None:
                    match[child] = match[fail[child]]
                queue.append(child)
        self._goto, self._fail, self._depth, self._match = goto, fail, depth, match
        self.state = 0

    def feed(self, text: str) -> tuple[int, str] | None:
        """Read ``text``; at the first stop string that ends in it, return (its end offset in ``text``, the stop
        string) and stop reading. Of stop strings ending at the same character the longest wins."""
        goto, fail, match = self._goto, self._fail, self._match
        node = self.state
        for i, ch in enumerate(text):
            while node and ch not in goto[node]:
                node = fail[node]
            node = goto[node].get(ch, 0)
            if match[node] is not None:
                self.state = node
                return i + 1, self.stop[match[node]]
        self.state = node
        return None

    @property
    def pending(self) -> int:
        """Characters at the end of the text read so far that may be the start of a stop string."""
        return self._depth[self.state]
