"""V4 MoE (spec §4.6): DeepSeekMoE (``layers/deepseek_moe.py``, shared with V3) with V4's settings.

  scores = sqrt(softplus(x @ Wg.T))                           (fp32)
  ids    = tid2eid[token_id]                   hash layers    (a frozen table; the gate still weights them)
         = top-k(scores + e_score_correction_bias)  otherwise (the bias only selects; ties -> lowest expert id)
  w      = scores[ids] / sum * routed_scaling_factor
  y      = sum_k w_k expert_{ids_k}(x) + shared_expert(x),  expert = W2(silu(min(W1 x, L)) * clamp(W3 x, -L, L))
What differs from V3 is configuration only: every layer is MoE, the first ``num_hash_layers`` are hash-routed,
no group-limited routing (V4 configs have no n_group), and ``swiglu_limit`` clamps routed and shared experts.
MXFP4 routed experts (``expert_dtype: fp4``, V4-Flash) stay packed as loaded (``layers/mxfp4.py``) unless
``OPENINFER_MXFP4_EXPERTS=dequantize``; the shared expert ships in FP8 (spec §3) and is dequantised like the linears.
"""
from __future__ import annotations

import torch

from openinfer.layers.deepseek_moe import DeepseekMoE
from openinfer.layers.mxfp4 import packed_experts_enabled
from openinfer.models.deepseek_v4.config import DeepseekV4Config


class DeepseekV4MoE(DeepseekMoE):
    def __init__(self, cfg: DeepseekV4Config, layer_idx: int) -> None:
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_shared_experts, cfg.router,
                         swiglu_limit=cfg.swiglu_limit,
                         hash_vocab_size=cfg.vocab_size if cfg.is_hash_layer(layer_idx) else None,
                         mxfp4_experts=cfg.expert_dtype == "fp4" and packed_experts_enabled(),
                         fp8_block=None if cfg.expert_dtype == "fp4" else cfg.fp8_block)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(x, input_ids)
