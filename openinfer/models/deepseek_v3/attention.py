"""DeepSeek-V3 multi-head latent attention: the projections around ``layers/mla.py``'s latent-cache attention."""
from __future__ import annotations

import torch
from torch import nn

from openinfer.config import AttentionBackend
from openinfer.distributed.parallel_state import get_tensor_model_parallel_world_size
from openinfer.layers import decode_blocks
from openinfer.layers.linear import CheckpointLinear
from openinfer.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, divide
from openinfer.layers.mla import MLAAttention
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import apply_interleaved, apply_neox, softmax_scale
from openinfer.models.deepseek_v3.config import DeepseekV3Args

# The small norms inside MLA use DeepSeek's default eps, not rms_norm_eps (HF and DeepSeek's code agree).
_LORA_NORM_EPS = 1e-6


class DeepseekV3Attention(nn.Module):
    def __init__(self, a: DeepseekV3Args, backend: AttentionBackend) -> None:
        super().__init__()
        total_heads = a.num_attention_heads
        # Tensor parallel: each rank holds a slice of the heads; the latent (c_kv | k_pe) is per token, not per
        # head, so every rank computes and caches all of it.
        self.num_heads = divide(total_heads, get_tensor_model_parallel_world_size(), "num_attention_heads")
        self.q_lora_rank = a.q_lora_rank
        self.kv_lora_rank = a.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = a.qk_nope_head_dim, a.qk_rope_head_dim
        self.rope_interleave = a.rope_interleave
        qk_head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(a.hidden_size, [total_heads * qk_head_dim], bias=False)
        else:
            self.q_a_proj = CheckpointLinear(a.hidden_size, a.q_lora_rank, bias=a.attention_bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(a.q_lora_rank, [total_heads * qk_head_dim], bias=False)
        self.kv_a_proj_with_mqa = CheckpointLinear(a.hidden_size, a.kv_lora_rank + a.qk_rope_head_dim,
                                                   bias=a.attention_bias)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(a.kv_lora_rank, [total_heads * (a.qk_nope_head_dim + a.v_head_dim)],
                                              bias=False)
        self.kv_b_proj.prepack = False  # MLA reads W_UK / W_UV out of this weight (absorbed decode, decompression)
        self.o_proj = RowParallelLinear(total_heads * a.v_head_dim, a.hidden_size, bias=a.attention_bias)
        self.mla = MLAAttention(self.num_heads, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim,
                                a.v_head_dim, softmax_scale(qk_head_dim, a.rope), backend)
        # decode steps may run as one op (_decode_block): one rank, the fast MLA path, DeepSeek's interleaved rope
        self._block_ok = (self.num_heads == total_heads and backend != AttentionBackend.REFERENCE
                          and a.rope_interleave)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        fused = self._decode_block(x, cos, sin)
        if fused is not None:
            return fused
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.num_heads, -1).split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe, k_pe = self._rope(q_pe, cos, sin), self._rope(k_pe, cos, sin)
        return self.o_proj(self.mla(q_nope, q_pe, c_kv, k_pe, self.kv_b_proj.weight))

    def _decode_block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """This forward as one op (layers/decode_blocks.py, the same bits) for a step of decodes only, when every
        matrix is in the panel layout; None otherwise."""
        md = decode_blocks.decode_only_step(x) if self._block_ok else None
        if md is None:
            return None
        lin = decode_blocks.linear_panels
        q_b_proj = self.q_proj if self.q_lora_rank is None else self.q_b_proj
        q_a = None if self.q_lora_rank is None else lin(self.q_a_proj)
        q_b, kv_a, o_proj = lin(q_b_proj), lin(self.kv_a_proj_with_mqa), lin(self.o_proj)
        if any(p is None for p in (q_b, kv_a, o_proj)) or (q_a is None and self.q_lora_rank is not None):
            return None
        absorbed = self.mla._absorbed_panels(self.kv_b_proj.weight)
        if absorbed is None:
            return None
        return decode_blocks.mla_decode_block(
            x, q_a, getattr(self, "q_a_layernorm", None), q_b, q_b_proj.out_features, kv_a, self.kv_a_layernorm,
            absorbed, o_proj, self.o_proj.out_features, cos, sin, self.mla, md, _LORA_NORM_EPS)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # DeepSeek rotates adjacent pairs; HF's port writes them de-interleaved (q and k alike, so q.k holds) and
        # the cache stores k_pe that way. Without rope_interleave the checkpoint uses rotate-half.
        if self.rope_interleave:
            return apply_interleaved(x, cos, sin, deinterleave=True)
        return apply_neox(x, cos, sin)
