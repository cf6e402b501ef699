"""V4 MoE (spec §4.6): every layer; sqrtsoftplus scores, hash routing on the first layers, shared expert.

  scores = sqrt(softplus(x @ Wg.T))                           (fp32)
  ids    = tid2eid[token_id]                   hash layers    (a frozen table; the gate still weights them)
         = top-k(scores + e_score_correction_bias)  otherwise (the bias only selects; ties -> lowest expert id)
  w      = scores[ids] / sum * routed_scaling_factor
  y      = sum_k w_k expert_{ids_k}(x) + shared_expert(x),  expert = W2(silu(min(W1 x, L)) * clamp(W3 x, -L, L))
No group-limited routing (V4 configs have no n_group). Experts run through ``fused_experts`` (grouped matmul).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.layers.moe import fused_experts, swiglu
from openinfer.models.deepseek_v4.common import Linear, fp32_param
from openinfer.models.deepseek_v4.config import DeepseekV4Config


def score_fn(name: str, logits: torch.Tensor) -> torch.Tensor:
    if name == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if name == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


class V4Router(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, is_hash: bool) -> None:
        super().__init__()
        self.is_hash = is_hash
        self.top_k = cfg.num_experts_per_tok
        self.scoring_func = cfg.scoring_func
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size), requires_grad=False)
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.e_score_correction_bias = fp32_param(cfg.n_routed_experts)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] fp32, expert ids [T, k] long)."""
        scores = score_fn(self.scoring_func, F.linear(x, self.weight).float())
        if self.is_hash:
            ids = self.tid2eid[input_ids]
        else:
            # A stable sort, not torch.topk: the tie order of topk kernels can depend on the batch shape.
            choice = scores + self.e_score_correction_bias
            ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :self.top_k]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class V4Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        # [E, 2I, H] gate rows then up rows (checkpoint w1 then w3), [E, H, I] (w2) - fused_experts' layout.
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)


class V4SharedExpert(nn.Module):
    def __init__(self, hidden: int, intermediate: int, limit: float | None) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x), self.limit))


class DeepseekV4MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_idx: int) -> None:
        super().__init__()
        self.swiglu_limit = cfg.swiglu_limit
        self.gate = V4Router(cfg, cfg.is_hash_layer(layer_idx))
        self.experts = V4Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = V4SharedExpert(cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size,
                                                 cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        y = fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, self.swiglu_limit)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


def reference_route(router: V4Router, x: torch.Tensor, input_ids: torch.Tensor):
    """Token by token, in plain Python: what ``V4Router.forward`` must equal."""
    weights, ids = [], []
    for i in range(x.shape[0]):
        logits = [float(v) for v in (router.weight.float() @ x[i].float())]
        if router.scoring_func == "sqrtsoftplus":
            s = [float(torch.nn.functional.softplus(torch.tensor(v)).sqrt()) for v in logits]
        elif router.scoring_func == "sigmoid":
            s = [1 / (1 + torch.exp(torch.tensor(-v)).item()) for v in logits]
        else:
            s = torch.softmax(torch.tensor(logits), 0).tolist()
        if router.is_hash:
            chosen = [int(e) for e in router.tid2eid[int(input_ids[i])]]
        else:
            bias = router.e_score_correction_bias.tolist()
            chosen = sorted(range(len(s)), key=lambda e: (-(s[e] + bias[e]), e))[:router.top_k]
        w = [s[e] for e in chosen]
        total = sum(w) + 1e-20 if router.norm_topk_prob else 1.0
        weights.append([v / total * router.routed_scaling_factor for v in w])
        ids.append(chosen)
    return torch.tensor(weights), torch.tensor(ids)
