"""Trace block -> prompt token ids, exactly.

Prompts go to ``/v1/completions`` as token-id lists, so no tokenizer round trip can merge or split tokens
at block edges: a request with ``in`` tokens is exactly ``in`` ids, and equal hash ids give equal id
blocks, which is what the server's prefix cache keys on. A text or chat prompt could not promise this
(BPE merges across block boundaries, chat templates add tokens), so it is not offered.

Each block's ids are drawn from a PRNG seeded by (salt, hash id) over the vocabulary minus special tokens;
a partial last block is the leading part of the same draw. A different salt gives different ids for every
block, so reruns (or replay passes) don't hit each other's cache. With the trace's block size a multiple
of the server's KV block size, cached blocks line up with the trace's.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class Filler:
    def __init__(self, allowed_ids: Sequence[int], block_size: int = 64, salt: str = "") -> None:
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        if len(allowed_ids) < 2:
            raise ValueError("the filler needs at least 2 usable token ids")
        self.allowed = np.asarray(sorted(set(int(i) for i in allowed_ids)), dtype=np.int64)
        self.block_size = block_size
        self.salt = salt
        # Blocks recur turn after turn as conversations grow; a bounded LRU keeps a long trace's memory
        # flat (a miss only costs a re-draw, about 10 us).
        self._cache: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self.cache_blocks = 1 << 16

    @classmethod
    def for_tokenizer(cls, tokenizer, block_size: int = 64, salt: str = "") -> Filler:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        return cls([i for i in range(len(tokenizer)) if i not in special], block_size, salt)

    def block(self, hash_id: int, salt: str | None = None) -> np.ndarray:
        salt = self.salt if salt is None else salt
        key = (salt, hash_id)
        ids = self._cache.get(key)
        if ids is not None:
            self._cache.move_to_end(key)
        else:
            # A stable digest, not Python's hash(): the same (salt, id) must give the same ids in every
            # process, or two clients replaying one trace would not share blocks.
            digest = hashlib.blake2b(f"{salt}\x00{hash_id}".encode(), digest_size=16).digest()
            rng = np.random.default_rng(int.from_bytes(digest, "little"))
            ids = self.allowed[rng.integers(0, len(self.allowed), size=self.block_size)]
            self._cache[key] = ids
            if len(self._cache) > self.cache_blocks:
                self._cache.popitem(last=False)
        return ids

    def prompt(self, hash_ids: Sequence[int], input_len: int, salt: str | None = None) -> list[int]:
        need = -(-input_len // self.block_size)
        if len(hash_ids) != need:
            raise ValueError(f"{len(hash_ids)} hash ids cannot make {input_len} tokens (need {need})")
        return np.concatenate([self.block(h, salt) for h in hash_ids])[:input_len].tolist()
