"""Stop strings through one automaton: the same first match and hold-back as checking every stop string at every
position, however the text is split into tokens, at a cost per character that does not grow with the list."""
from __future__ import annotations

import random
import time

import pytest

from openinfer.engine.stop_strings import StopStringMatcher


def _first_match(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Reference: the stop string ending first in the text (the longest of those ending at the same place)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def _hold(text: str, stops: list[str]) -> int:
    """Reference: the longest suffix of the text that is a proper prefix of some stop string."""
    return max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
               default=0)


def test_matches_the_brute_force_reference_for_any_split():
    rng = random.Random(0)
    for _ in range(3000):
        stops = list({"".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))})
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 14)))
        m = StopStringMatcher(stops)
        pos, got = 0, None
        while pos < len(text):
            k = rng.randint(1, 3)
            hit = m.feed(text[pos:pos + k])
            if hit is not None:
                got = (pos + hit[0], hit[1])
                break
            pos += k
        assert got == _first_match(text, stops), (stops, text)
        if got is None:
            assert m.pending == _hold(text, stops), (stops, text)


@pytest.mark.serial  # compares two timings: a busy neighbour skews one of them
def test_cost_per_character_does_not_grow_with_the_number_of_stop_strings():
    few = StopStringMatcher(["stop000000"])
    many = StopStringMatcher([f"stop{i:06d}" for i in range(20_000)])
    text = "hello world, no stop here; just text " * 50

    def per_char(m: StopStringMatcher) -> float:
        t0 = time.perf_counter()
        for _ in range(20):
            m.state = 0
            assert m.feed(text) is None
        return (time.perf_counter() - t0) / (20 * len(text))

    per_char(few), per_char(many)  # warm up
    assert per_char(many) < 3 * per_char(few) + 1e-6
    assert many.feed("xxstop012345") == (12, "stop012345")
