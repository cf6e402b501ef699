"""V4.1 MoE (spec §7.7): V4's sqrtsoftplus DeepSeekMoE without hash-routed layers. The checkpoint also carries
``ffn.gate.bias_vl``, the selection bias of image tokens: a row of an image's positions (its markers included,
DeepInfer's ``images_seq_mask = mm_token_type >= IMAGE``) selects its experts with ``bias_vl`` in place of
``bias``; the weights still come from the scores alone. The DSpark draft blocks use fewer experts (``dspark_n_routed_experts`` /
``dspark_num_experts_per_tok``) with the same widths. MXFP4 routed experts (``expert_dtype: fp4``) stay packed as
loaded (``layers/mxfp4.py``), as V4's, unless ``OPENINFER_MXFP4_EXPERTS=dequantize``."""
from __future__ import annotations

import dataclasses

import torch

from openinfer.layers.deepseek_moe import DeepseekMoE, route
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

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None,
                image_rows: torch.Tensor | None = None) -> torch.Tensor:
        if image_rows is None or not bool(image_rows.any()):
            return super().forward(x, token_ids)
        gate = self.gate
        logits = x.float() @ gate.weight.float().t()
        weights = torch.empty(x.shape[0], gate.cfg.num_experts_per_tok, dtype=torch.float32, device=x.device)
        ids = torch.empty(weights.shape, dtype=torch.long, device=x.device)
        for rows, bias in ((image_rows, gate.bias_vl), (~image_rows, gate.e_score_correction_bias)):
            if bool(rows.any()):
                weights[rows], ids[rows] = route(logits[rows], gate.cfg, bias)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        out = self.experts(x, weights, ids, out=shared)
        return self.experts.tp.all_reduce(out) if self.tp_reduce else out
