"""V4.1 MoE (spec §7.7): V4's sqrtsoftplus DeepSeekMoE without hash-routed layers. The checkpoint also carries
``ffn.gate.bias_vl``, the selection bias for image tokens; held (so loading is exact) and unused while the vision
tower is not supported."""
from __future__ import annotations

import torch

from openinfer.layers.deepseek_moe import DeepseekMoE
from openinfer.models.deepseek_v41.config import DeepseekV41Config


class MoE(DeepseekMoE):
    def __init__(self, cfg: DeepseekV41Config) -> None:
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_shared_experts, cfg.router,
                         swiglu_limit=cfg.swiglu_limit)
        self.gate.register_parameter(
            "bias_vl", torch.nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32),
                                          requires_grad=False))
