"""Llama / Qwen2 / Qwen3 dense decoders, HF-shaped, over a flat token batch ``[T]`` (no batch dimension).

Differences between the families are config switches: Qwen2 has q/k/v biases, Qwen3 normalises q and k per
head. q/k/v and gate/up are fused into one matmul each; ``load_weights`` maps HF's separate tensors onto the
fused shards. Under tensor parallelism each rank holds a slice of the heads, of the MLP's intermediate and of the
vocabulary (layers/parallel_linear.py, vocab_parallel_embedding.py) and reads only that slice of each tensor.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from openinfer.config import AttentionBackend
from openinfer.forward_context import get_forward_context
from openinfer.kv_cache_interface import KVGroupSpec
from openinfer.layers import cpu_ops, decode_blocks
from openinfer.layers.activation import SiluAndMul
from openinfer.layers.attention import Attention, bind_layer_caches, free_layer_caches, paged_attention_spec
from openinfer.layers.linear import Linear
from openinfer.layers.gguf_quant import GGUFWeight
from openinfer.layers.norm import RMSNorm
from openinfer.layers.quant_linear import QuantizedWeight
from openinfer.layers.parallel_linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from openinfer.layers.rotary import RotaryEmbedding, apply_neox, rope_parameters
from openinfer.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from openinfer.models.interface import CausalLM, ParallelMode
from openinfer.models.weights import WeightLoadError, copy_into


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], qk_norm: bool, bias: bool, o_bias: bool,
                 rotary_emb: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        total_heads = cfg["num_attention_heads"]
        self.head_dim = cfg.get("head_dim") or hidden // total_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads,
                                          cfg.get("num_key_value_heads") or total_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            eps = cfg.get("rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(self.head_dim, eps)
            self.k_norm = RMSNorm(self.head_dim, eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qkv[:, :self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
            cos, sin = self.rotary_emb.cos_sin(positions)
            q, k = apply_neox(q, cos, sin), apply_neox(k, cos, sin)
        elif self._fused_rotary_cache_write(positions, qkv):
            q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
            return self.o_proj(self.attn(q, k, v, kv_cached=True))
        else:
            # q and k sit side by side in the fused projection: rotate them as one [T, Hq + Hk, D] tensor.
            cos, sin = self.rotary_emb.cos_sin(positions)
            qk = apply_neox(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        return self.o_proj(self.attn(q, k, v))

    def _fused_rotary_cache_write(self, positions: torch.Tensor, qkv: torch.Tensor) -> bool:
        """On CPU: rotary on q and k in place in the fused projection and k / v into the paged cache, one
        kernel pass (cpu_kernels/layer_ops.cpp) instead of ~10 ops. False where the kernel does not apply."""
        a, rot = self.attn, self.rotary_emb
        if a.k_cache is None:
            return False
        slots = get_forward_context().group(a.kv_group).slot_mapping
        return cpu_ops.rotary_cache_write_(qkv, positions, rot.cos, rot.sin, a.k_cache, a.v_cache, slots,
                                           self.num_heads, self.num_kv_heads, self.head_dim, rot.rot_dim)


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], qk_norm: bool, qkv_bias: bool, o_bias: bool,
                 rotary_emb: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(cfg, qk_norm, qkv_bias, o_bias, rotary_emb, backend)
        self.mlp = LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"], bool(cfg.get("mlp_bias", False)))
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        # decode steps may run as one op (_decode_block): one rank (every linear here shares the TP group), the fast
        # attention path, no q / k norms; it takes one eps, which both norms share
        self._block_ok = (not qk_norm and backend != AttentionBackend.REFERENCE
                          and self.self_attn.qkv_proj.tp.world_size == 1)

    def _decode_block(self, positions, x, residual):
        """This forward as one op (layers/decode_blocks.py, the same bits) for a step of decodes only on the CPU,
        every matrix in the panel layout or W4A8 / W8A8; None otherwise."""
        md = decode_blocks.decode_only_step(x) if self._block_ok else None
        return None if md is None else decode_blocks.llama_decode_layer(self, positions, x, residual, md)

    def forward(self, positions, x, residual):
        fused = self._decode_block(positions, x, residual)
        if fused is not None:
            return fused
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], qk_norm: bool, qkv_bias: bool, o_bias: bool,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        rot_dim = int(head_dim * float(cfg.get("partial_rotary_factor") or 1.0))
        rotary = RotaryEmbedding(rot_dim, rope_parameters(cfg), cfg.get("max_position_embeddings", 2048))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, qk_norm, qkv_bias, o_bias, rotary, backend)
            for _ in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        stacked = decode_blocks.llama_decode_stack(self, positions, x)  # a decode-only step: every layer in one op
        if stacked is not None:
            x, _ = self.norm(*stacked)
            return x
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(CausalLM):
    qk_norm = False
    qkv_bias = False
    supported_kv_cache_dtypes = ("auto", "fp8", "fp8_e4m3")  # engine_args checks kv_cache_dtype against it
    # --quantization (layers/quant_linear.py) and low-bit checkpoints (layers/checkpoint_quant.py); engine_args checks
    supported_quantization = ("int8", "int4", "w8a8", "w4a8")
    # heads, MLP and vocabulary split over TP ranks (layers/parallel_linear.py); dense, so expert parallelism
    # leaves it whole (its replicas only step in lockstep)
    supported_parallel_modes = frozenset({ParallelMode.TENSOR, ParallelMode.DATA, ParallelMode.EXPERT})
    # HF name fragment -> (fused parameter fragment, part)
    stacked_params = [
        ("q_proj", "qkv_proj", 0),
        ("k_proj", "qkv_proj", 1),
        ("v_proj", "qkv_proj", 2),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    ]

    def __init__(self, cfg: dict[str, Any], *, attention_backend: AttentionBackend = AttentionBackend.SDPA) -> None:
        super().__init__()
        self.config = cfg
        attention_bias = bool(cfg.get("attention_bias", False))
        # Qwen2 always has q/k/v biases and never an o_proj bias; Llama/Qwen3 follow attention_bias for all four.
        self.model = LlamaModel(cfg, self.qk_norm, self.qkv_bias or attention_bias,
                                attention_bias and not self.qkv_bias, attention_backend)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"])
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> list[KVGroupSpec]:
        return paged_attention_spec(self.attention_layers(), block_size, dtype)

    def bind_kv_cache(self, num_blocks: Mapping[str, int], block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        bind_layer_caches(self.attention_layers(), num_blocks, block_size, dtype, device)

    def free_kv_cache(self) -> None:
        free_layer_caches(self.attention_layers())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Each checkpoint tensor goes to its parameter's ``weight_loader`` (which reads this rank's slice), HF's
        separate q/k/v and gate/up tensors to their part of the fused parameter."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            pname, part = name, None
            for src, fused, p in self.stacked_params:
                if f".{src}." in name:
                    pname, part = name.replace(f".{src}.", f".{fused}."), p
                    break
            param = params.get(pname)
            if param is None:
                raise WeightLoadError(f"checkpoint tensor {name!r} does not belong to this model")
            loader = getattr(param, "weight_loader", None)
            if isinstance(tensor, (QuantizedWeight, GGUFWeight)):  # a low-bit checkpoint's linear, packed
                module = self.get_submodule(pname.rpartition(".")[0])
                # a GGUF file's token embedding may be quantized too (looked up row by row)
                embedding = isinstance(tensor, GGUFWeight) and isinstance(module, VocabParallelEmbedding)
                if not isinstance(module, Linear) and not embedding:
                    raise WeightLoadError(f"checkpoint tensor {name!r} is quantised but {pname!r} is not a linear "
                                          "weight (embeddings and a tied or untied LM head stay dense)")
                try:
                    module.load_quantized(tensor, part)
                except ValueError as e:
                    raise WeightLoadError(f"checkpoint tensor {name!r}: {e}") from None
            elif loader is not None:
                loader(param, tensor, part)
            else:
                copy_into(param, tensor, name)
            loaded.add(pname if part is None else f"{pname}#{part}")
        parts_of: dict[str, list[int]] = {}
        for _, fused, p in self.stacked_params:
            parts_of.setdefault(fused, []).append(p)
        expected: set[str] = set()
        for pname in params:
            fused = next((f for f in parts_of if f".{f}." in pname), None)
            if fused is None:
                expected.add(pname)
            else:
                expected.update(f"{pname}#{p}" for p in parts_of[fused])
        missing = expected - loaded
        if missing:
            raise WeightLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
        embed = self.model.embed_tokens
        if self.tie_word_embeddings and embed._quant is not None:  # the head multiplies by the same packed table
            self.lm_head.load_quantized(embed._quant)
        return loaded


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
