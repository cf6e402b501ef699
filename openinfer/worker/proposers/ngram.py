"""Prompt lookup (n-gram) drafting: no weights, just the request's own tokens.

For n from ``max_n`` down to ``min_n``: if the last n tokens occurred earlier in the prompt + output, the tokens
that followed their most recent earlier occurrence are the drafts (up to k). Cheap, and strong wherever outputs
copy from the context (code editing, agents quoting tool results).
"""
from __future__ import annotations

import numpy as np

from openinfer.worker.proposers import ProposeInputs, Proposer


def ngram_drafts(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # every n-gram ending before the last token
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # what followed the most recent earlier occurrence
            return arr[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, step: ProposeInputs) -> dict[str, list[int]]:
        out = {}
        for r in step.sampled:
            drafts = ngram_drafts(r.state.token_ids, self.k, self.min_n, self.max_n)
            if drafts:
                out[r.state.req_id] = drafts
        return out
