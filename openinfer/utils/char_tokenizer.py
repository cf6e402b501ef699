"""Writers for small HF-format tokenizers used by tests, checkpoint generators and benchmarks.

A character-level tokenizer is fast to build offline, deterministic, and round-trips any ASCII text, which
is all random-weight checkpoints need.
"""
from __future__ import annotations

import string
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_char_tokenizer(path: str | Path, vocab_size: int) -> None:
    """A character-level tokenizer (fast, offline, deterministic) padded with filler tokens to vocab_size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    i = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<x{i}>"] = i
        i += 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|[a-z]+\|>|<x\d+>|</?s>|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": specials[3:]})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
