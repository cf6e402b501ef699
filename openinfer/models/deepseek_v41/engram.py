"""Engram (spec §7.6, DeepInfer ``v4_modules/engram*.py``, the DeepSeek Engram demo): hashed n-gram embeddings
gated into the mHC streams, at the start of the layers in ``engram_layer_ids`` (after the previous sub-layer's
post, before this layer's attention pre).

Hashing, per Engram layer, of the tokens ids[p], ids[p-1], ... (positions before 0 read ``engram_pad_token_id``):
  multipliers m_0..m_{N-1} = 2 * numpy.default_rng(10007 * layer).integers(0, B, N, int64) + 1,
                             B = max(1, (int64_max // tokenizer_vocab_size) // 2)
  mix_n   = XOR_{k<n} (ids[p-k] * m_k)      (int64, wrapping)         for n = 2..N
  hash    = mix_n mod P_{n,h}                for each head h; the table sizes P are distinct primes, the next
            prime >= engram_vocab_size per (layer, order, head) in that order, unique across all layers
  e_p     = concat_{n,h} table[offset_{n,h} + hash]                  -> [(N-1) * heads * head_dim]
Gate (per stream j; keys are the first hc_mult rows of wkv(e), the value the last):
  g_j = <RMSNorm(X_j) * q_weight_j, RMSNorm(key_j) * k_weight_j> / sqrt(D)
  X_j += sigmoid(sign(g_j) * sqrt(max(|g_j|, 1e-6))) * value
With ``engram_compressed_vocab_size`` the ids are first mapped to a compressed vocabulary (``compressed_vocabulary``:
each token decoded alone, NFKC / NFD / accents stripped / lower-cased / whitespace collapsed; tokens with the same
key share an id), the pad id too, and B is bounded by the compressed size.
No sentence-level mask: DeepInfer's config writes ``sentence_level_mask`` (bos / eos ids) into its Engram and
model configs (hugging_face/config.py:211 and :322) but nothing in its Python, C++ or CUDA source ever reads it, so
hashing runs across bos / eos like any other token, as here.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
from sympy import nextprime

from openinfer.layers.linear import CheckpointLinear
from openinfer.models.deepseek_v41.config import EngramConfig

CLAMP = 1e-6


def table_sizes(cfg: EngramConfig) -> dict[int, list[int]]:
    """layer -> the prime table size of each (order, head), orders 2..N outer, heads inner."""
    seen: set[int] = set()
    sizes: dict[int, list[int]] = {}
    for layer in cfg.layer_ids:
        per_layer = []
        for _ in range(cfg.max_ngram_size - 1):
            start = cfg.vocab_size - 1
            for _ in range(cfg.n_heads):
                prime = int(nextprime(start))
                while prime in seen:
                    prime = int(nextprime(prime))
                seen.add(prime)
                per_layer.append(prime)
                start = prime
        sizes[layer] = per_layer
    return sizes


def multipliers(cfg: EngramConfig, layer: int, seed: int = 0) -> np.ndarray:
    bound = max(1, (np.iinfo(np.int64).max // cfg.tokenizer_vocab_size) // 2)
    rng = np.random.default_rng(int(seed + 10007 * layer))
    return rng.integers(0, bound, size=(cfg.max_ngram_size,), dtype=np.int64) * 2 + 1


def compressed_vocabulary(tokenizer_file: str, expected_size: int) -> torch.Tensor:
    """old id -> compressed id [vocab] (DeepInfer ``CompressedVocabulary``); raises ValueError naming
    ``engram_compressed_vocab_size`` when the tokenizer gives another size."""
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(tokenizer_file)
    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " ")])
    ids: dict[str, int] = {}
    table = []
    for token_id in range(tok.get_vocab_size()):
        text = tok.decode([token_id], skip_special_tokens=False)
        # undecodable byte pieces keep their raw spelling so that distinct pieces never collapse
        key = tok.id_to_token(token_id) if "\ufffd" in text else (norm.normalize_str(text) or text)
        table.append(ids.setdefault(key, len(ids)))
    if len(ids) != expected_size:
        raise ValueError(f"engram_compressed_vocab_size={expected_size}, but {tokenizer_file} compresses to "
                         f"{len(ids)} tokens")
    return torch.tensor(table, dtype=torch.long)


class EngramTable(nn.Module):
    """Holds ``weight`` under the checkpoint's ``engram.embed.weight``."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)


class Engram(nn.Module):
    def __init__(self, cfg: EngramConfig, layer: int, hidden_size: int, hc_mult: int, eps: float,
                 sizes: list[int], lookup: torch.Tensor | None = None) -> None:
        super().__init__()
        self.hc_mult, self.hidden_size, self.eps = hc_mult, hidden_size, eps
        self.head_dim = cfg.head_dim
        self.embed = EngramTable(sum(sizes), cfg.head_dim)
        self.kv_proj = CheckpointLinear(cfg.embed_dim, hidden_size * (hc_mult + 1), bias=False)
        self.q_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, dtype=torch.float32), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, dtype=torch.float32), requires_grad=False)
        self.register_buffer("sizes", torch.tensor(sizes, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.tensor([0, *np.cumsum(sizes)[:-1].tolist()], dtype=torch.long),
                             persistent=False)
        self.register_buffer("mult", torch.from_numpy(multipliers(cfg, layer)), persistent=False)
        self.max_ngram_size, self.n_heads = cfg.max_ngram_size, cfg.n_heads
        self.register_buffer("lookup", lookup, persistent=False)  # tokenizer compression, or None

    def compress(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.lookup is None else self.lookup[ids]

    def hashes(self, history: torch.Tensor) -> torch.Tensor:
        """history [T, N] int64: column k = the id k positions back (pad before the start) -> rows [T, (N-1)*H]
        into the table (offsets added)."""
        prod = self.compress(history.long()) * self.mult  # int64 multiply wraps like numpy's
        cols = []
        mix = prod[:, 0]
        for n in range(2, self.max_ngram_size + 1):
            mix = torch.bitwise_xor(mix, prod[:, n - 1])
            cols.extend([mix] * self.n_heads)
        mixes = torch.stack(cols, dim=1)
        return torch.remainder(mixes, self.sizes) + self.offsets

    def forward(self, X: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """X [T, n, D] streams, history [T, N] ids -> gated streams."""
        e = self.embed.weight[self.hashes(history)].flatten(1)
        kv = self.kv_proj(e.to(X.dtype)).view(-1, self.hc_mult + 1, self.hidden_size).float()
        keys, value = kv[:, :-1], kv[:, -1]
        q = torch.nn.functional.rms_norm(X.float(), (self.hidden_size,), None, self.eps) * self.q_weight
        k = torch.nn.functional.rms_norm(keys, (self.hidden_size,), None, self.eps) * self.k_weight
        g = (q * k).sum(-1) / self.hidden_size ** 0.5
        g = torch.sigmoid(g.sign() * g.abs().clamp_min(CLAMP).sqrt())
        return (X.float() + g.unsqueeze(-1) * value.unsqueeze(1)).to(X.dtype)
