"""A toy model whose KV cache has a kind of group the engine was never told about: two sliding windows of
different sizes plus full attention, three KV groups. Everything group-specific lives here, on the model side
(``kv_cache_spec`` declares the groups, the layers read their own group's tables from the forward context); the
engine, scheduler, block manager and runner are the ones every model uses.

Layer i attends over the last ``WINDOWS[i]`` positions (None = all), through a paged K/V cache in its group's
blocks. ``reference_logits`` computes the same network densely over a whole sequence with explicit masks, no
cache: what the engine's output must equal through chunked prefill, prefix hits and preemption.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from openinfer.config import AttentionBackend
from openinfer.forward_context import get_forward_context
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.models.interface import CausalLM
from openinfer.models.weights import WeightLoadError, copy_into

ARCH = "ToySlidingForCausalLM"
WINDOWS = (5, 11, None)  # positions a query reads, itself included; None = the whole sequence
HEADS, HEAD_DIM = 2, 8


def group_name(window: int | None) -> str:
    return "full" if window is None else f"window{window}"


class ToyAttention(nn.Module):
    def __init__(self, hidden: int, window: int | None) -> None:
        super().__init__()
        self.window = window
        self.kv_group = group_name(window)
        self.qkv = nn.Linear(hidden, 3 * HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, hidden, bias=False)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).view(x.shape[0], 3, HEADS, HEAD_DIM).unbind(1)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        md = get_forward_context()
        tables = md.group(self.kv_group)
        q, k, v = self.project(x)
        kc, vc = self.k_cache.view(-1, HEADS, HEAD_DIM), self.v_cache.view(-1, HEADS, HEAD_DIM)
        kc.index_copy_(0, tables.slot_mapping, k)
        vc.index_copy_(0, tables.slot_mapping, v)
        pos, rows = md.positions, md.token_rows
        span = int(pos.max()) + 1 if self.window is None else self.window
        key_pos = pos[:, None] - torch.arange(span - 1, -1, -1)  # [T, span], oldest first
        valid = key_pos >= 0
        kp = key_pos.clamp(min=0)
        bs = tables.tokens_per_block
        # Only positions inside the window are read: released blocks (placeholder ids) never are.
        slots = tables.block_tables[rows[:, None], kp // bs] * bs + kp % bs
        keys, vals = kc[slots], vc[slots]  # [T, span, H, D]
        scores = torch.einsum("thd,tshd->ths", q, keys) * HEAD_DIM ** -0.5
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        out = torch.einsum("ths,tshd->thd", scores.softmax(-1), vals)
        return self.o(out.reshape(x.shape[0], -1))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.project(x)
        p = torch.arange(n)
        mask = p[None, :] <= p[:, None]
        if self.window is not None:
            mask &= p[None, :] > p[:, None] - self.window
        scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM ** -0.5
        out = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
        return self.o(out.reshape(n, -1))


class ToyLayer(nn.Module):
    def __init__(self, hidden: int, window: int | None) -> None:
        super().__init__()
        self.attn = ToyAttention(hidden, window)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.Tanh(), nn.Linear(2 * hidden, hidden))


class ToySlidingForCausalLM(CausalLM):
    def __init__(self, cfg: dict[str, Any], *, attention_backend: AttentionBackend = AttentionBackend.SDPA) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.embed = nn.Embedding(cfg["vocab_size"], h)
        self.layers = nn.ModuleList(ToyLayer(h, w) for w in WINDOWS)
        self.lm_head = nn.Linear(h, cfg["vocab_size"], bias=False)

    def _run(self, ids: torch.Tensor, attend) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + attend(layer.attn, x)
            x = x + layer.mlp(x)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._run(input_ids, lambda attn, x: attn(x))

    @torch.inference_mode()
    def reference_logits(self, ids: list[int]) -> torch.Tensor:
        return self.compute_logits(self._run(torch.tensor(ids), lambda attn, x: attn.reference(x)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model")
            copy_into(params[name], tensor, name)
            loaded.add(name)
        if set(params) - loaded:
            raise WeightLoadError(f"checkpoint is missing {sorted(set(params) - loaded)[:5]}")
        return loaded

    # -- the KV cache: one group per window size, declared here and nowhere else ---------------------------
    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
        per_layer = 2 * HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size() * block_size
        specs = []
        for layer in self.layers:
            w = layer.attn.window
            specs.append(KVGroupSpec(group_name(w), per_layer, lookback_tokens=None if w is None else w - 1))
        return specs

    def bind_kv_cache(self, num_blocks: Mapping[str, int], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        for layer in self.layers:
            a = layer.attn
            shape = (num_blocks[a.kv_group], block_size, HEADS, HEAD_DIM)
            a.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            a.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def free_kv_cache(self) -> None:
        for layer in self.layers:
            layer.attn.k_cache = layer.attn.v_cache = None


def write_checkpoint(path, seed: int = 0, vocab_size: int = 96, hidden: int = 32) -> dict[str, Any]:
    """Random weights (large enough that greedy ties are unlikely), config and a char tokenizer."""
    import json

    from safetensors.torch import save_file

    from helpers import write_char_tokenizer

    cfg = {"architectures": [ARCH], "vocab_size": vocab_size, "hidden_size": hidden,
           "max_position_embeddings": 256, "eos_token_id": 1, "bos_token_id": 0}
    torch.manual_seed(seed)
    model = ToySlidingForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    write_char_tokenizer(path, vocab_size)
    return cfg
