"""Tokenizer work for the HTTP side, off the event loop.

The API owns its own tokenizer instance (the core thread detokenizes with the engine's) and runs every call
on one worker thread: HF fast tokenizers are not safe to share between threads, and a long prompt must not
stall the loop that streams everyone else's tokens.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from openinfer.tokenizer import apply_chat_template, load_tokenizer


class TokenizerService:
    def __init__(self, tokenizer_path: str, chat_template: str | None, tokenizer_mode: str = "auto") -> None:
        self.tokenizer = load_tokenizer(tokenizer_path, chat_template)
        self.tokenizer_mode = tokenizer_mode
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-tokenizer")
        self._token_strs: dict[int, str] = {}
        self.max_token_chars = max_token_chars(self.tokenizer)

    async def _run(self, fn, *args: Any, **kwargs: Any):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self._run(self.tokenizer.decode, ids, skip_special_tokens=skip_special_tokens)

    async def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, max_chars: int | None = None,
        **kwargs: Any
    ) -> list[int]:
        return await self._run(
            apply_chat_template,
            self.tokenizer,
            messages,
            add_generation_prompt,
            None,
            tokenizer_mode=self.tokenizer_mode,
            max_chars=max_chars,
            **kwargs,
        )

    async def token_strs(self, ids: list[int]) -> list[str]:
        """Each id decoded on its own (what OpenAI's ``logprobs.token`` fields show); cached per id."""
        missing = [i for i in set(ids) if i not in self._token_strs]
        if missing:
            decode = self.tokenizer.decode
            strs = await self._run(lambda: [decode([i]) for i in missing])
            self._token_strs.update(zip(missing, strs))
        return [self._token_strs[i] for i in ids]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def max_token_chars(tokenizer) -> int:
    """The most characters of input text one token can stand for: its vocabulary entry's length (byte-level and
    SentencePiece tokens spell each byte or space as one character, byte-fallback tokens as six). A prompt longer
    than ``max_model_len`` times this cannot fit and is refused before tokenizing."""
    vocab = tokenizer.get_vocab()
    longest = max((len(t) for t in vocab), default=1)
    return max(1, longest)
