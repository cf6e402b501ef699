"""V4.1 MoE (spec §7.7): V4's sqrtsoftplus DeepSeekMoE without hash-routed layers. The checkpoint also carries
``ffn.gate.bias_vl``, the selection bias for image tokens; held (so loading is exact) and unused while the vision
tower is not supported. The DSpark draft blocks use fewer experts (``dspark_n_routed_experts`` /
``dspark_num_experts_per_tok``) with the same widths. MXFP4 routed experts (``expert_dtype: fp4``) stay packed as
loaded (``layers/mxfp4.py``), as V4's, unless ``OPENINFER_MXFP4_EXPERTS=dequantize``."""
from __future__ import annotations

import dataclasses

import torch

from openinfer.layers.deepseek_moe import DeepseekMoE
from openinfer.layers.mxfp4 import packed_experts_enabled
from openinfer.models.deepseek_v41.config import DeepseekV41Config


class MoE(DeepseekMoE):
    def __init__(self, cfg: DeepseekV41Config, n_routed_experts: int | None = None,
                 num_experts_per_tok: int | None = None) -> None:
        router = cfg.router
        if n_routed_experts is not None:
            router = dataclasses.replace(router, n_routed_experts=n_routed_experts,
                                         num_experts_per_tok=num_experts_per_tok)
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_shared_experts, router,
                         swiglu_limit=cfg.swiglu_limit,
                         mxfp4_experts=cfg.expert_dtype == "fp4" and packed_experts_enabled())
        self.gate.register_parameter(
            "bias_vl", torch.nn.Parameter(torch.zeros(router.n_routed_experts, dtype=torch.float32),
                                          requires_grad=False))
