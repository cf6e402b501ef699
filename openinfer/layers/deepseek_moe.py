"""DeepSeekMoE for V3 and V4: the router (``route``), stacked routed and shared experts, HF-shaped names.

Routing (``topk_method="noaux_tc"``):
  scores = score_fn(x @ Wg.T) in fp32                  (sigmoid for V3, sqrtsoftplus for V4)
  choice = scores + e_score_correction_bias            (the bias only *selects*; weights come from scores)
  group-limited: keep the ``topk_group`` of ``n_group`` groups with the largest sum-of-top-2 choice score,
  then top-k experts among the kept groups;
  hash routing (V4's first layers): the experts are ``tid2eid[token_id]``, a frozen table (no bias/groups);
  weights = scores at the chosen experts, optionally renormalised, times ``routed_scaling_factor``.
Ties are broken towards the lowest expert index (a stable sort), never by whatever ``torch.topk`` happens to
do: a kernel's tie order can depend on tensor length, which would make routing batch-dependent.
V4's experts (routed and shared) clamp the SwiGLU inputs at ``swiglu_limit``; V3's do not (``None``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.distributed.parallel_state import get_eplb_settings, get_ep_group, get_tp_group
from openinfer.forward_context import peek_forward_context
from openinfer.layers import cpu_ops, decode_blocks
from openinfer.layers.expert_map import ExpertMap
from openinfer.layers.expert_parallel import expert_parallel_experts
from openinfer.layers.fp8 import Fp8Weight, packed_fp8_enabled, stacked_fp8
from openinfer.layers.mxfp4 import MXFP4_BLOCK, Mxfp4Tensor, stacked_mxfp4
from openinfer.layers.moe import combine_experts, experts_on_sorted_rows, fused_experts, swiglu
from openinfer.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, divide
from openinfer.layers.quant_linear import QuantizedWeight
from openinfer.layers.weight_utils import WeightLoadError, materialize, narrow

# New score functions are added here; RouterConfig validates against this table.
SCORING_FUNCS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "softmax": lambda logits: logits.softmax(dim=-1),
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
}
TOPK_METHODS = ("noaux_tc",)


@dataclass(frozen=True)
class RouterConfig:
    """Routing hyper-parameters under their HF config names, validated once at model construction."""

    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        e, k = self.n_routed_experts, self.num_experts_per_tok
        if not isinstance(e, int) or e <= 0:
            raise ValueError(f"n_routed_experts={e!r} must be a positive int")
        if not isinstance(k, int) or not 0 < k <= e:
            raise ValueError(f"num_experts_per_tok={k!r} must be in [1, n_routed_experts={e}]")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func={self.scoring_func!r} is not supported "
                             f"(supported: {', '.join(SCORING_FUNCS)})")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method={self.topk_method!r} is not supported "
                             f"(supported: {', '.join(TOPK_METHODS)})")
        if not isinstance(self.n_group, int) or self.n_group <= 0 or e % self.n_group:
            raise ValueError(f"n_group={self.n_group!r} must be a positive divisor of n_routed_experts={e}")
        if not isinstance(self.topk_group, int) or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group!r} must be in [1, n_group={self.n_group}]")
        per_group = e // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError(f"n_group={self.n_group} leaves {per_group} expert per group; the group score "
                             "is the sum of the top-2 experts, so each group needs at least 2")
        if k > self.topk_group * per_group:
            raise ValueError(f"num_experts_per_tok={k} exceeds the {self.topk_group * per_group} experts in "
                             f"topk_group={self.topk_group} groups")
        if self.routed_scaling_factor <= 0:
            raise ValueError(f"routed_scaling_factor={self.routed_scaling_factor!r} must be > 0")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> RouterConfig:
        # transformers drops scoring_func/topk_method when it saves V3 (spec §12): absent = sigmoid/noaux_tc.
        return cls(
            n_routed_experts=cfg.get("n_routed_experts"),
            num_experts_per_tok=cfg.get("num_experts_per_tok"),
            scoring_func=cfg.get("scoring_func") or "sigmoid",
            topk_method=cfg.get("topk_method") or "noaux_tc",
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        )


def _topk_lowest_index(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def route(router_logits: torch.Tensor, cfg: RouterConfig,
          e_score_correction_bias: torch.Tensor | None = None,
          hash_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights fp32 [T, K], topk_ids int64 [T, K]); see the module docstring.

    ``hash_ids`` [T, K] (``tid2eid[token_ids]``) replaces the selection; a hash layer has no correction
    bias, so passing both is a caller bug and raises."""
    t, e = router_logits.shape
    scores = SCORING_FUNCS[cfg.scoring_func](router_logits.float())
    if hash_ids is not None:
        if e_score_correction_bias is not None:
            raise ValueError("hash routing takes no e_score_correction_bias: the table alone selects")
        if tuple(hash_ids.shape) != (t, cfg.num_experts_per_tok):
            raise ValueError(f"hash_ids has shape {tuple(hash_ids.shape)}, expected "
                             f"({t}, num_experts_per_tok={cfg.num_experts_per_tok})")
        topk_ids = hash_ids.long()
    else:
        # one pass per token in the CPU kernel (the same choice, the same tie rule), else torch ops
        topk_ids = cpu_ops.moe_select(scores, e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group,
                                      cfg.topk_group)
        if topk_ids is None:
            topk_ids = _select(scores, cfg, e_score_correction_bias)
    topk_weights = scores.gather(1, topk_ids)
    if cfg.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * cfg.routed_scaling_factor, topk_ids


def _select(scores: torch.Tensor, cfg: RouterConfig, bias: torch.Tensor | None) -> torch.Tensor:
    t, e = scores.shape
    choice = scores if bias is None else scores + bias.float()
    if cfg.topk_group < cfg.n_group:
        grouped = choice.view(t, cfg.n_group, e // cfg.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # values only: tie order is irrelevant
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, _topk_lowest_index(group_scores, cfg.topk_group), True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)
    return _topk_lowest_index(choice, cfg.num_experts_per_tok)


class DeepseekTopkRouter(nn.Module):
    """``mlp.gate``: router weight in the model dtype (as HF), correction bias kept in fp32 (as HF).

    With ``hash_vocab_size`` (V4's hash layers) the gate holds the frozen ``tid2eid [vocab, K]`` table
    instead of the bias, and ``forward`` needs the token ids."""

    def __init__(self, hidden_size: int, cfg: RouterConfig, hash_vocab_size: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.is_hash = hash_vocab_size is not None
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, hidden_size), requires_grad=False)
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab_size, cfg.num_experts_per_tok,
                                                        dtype=torch.long))
        else:
            bias = torch.zeros(cfg.n_routed_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor,
                token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 logits: in bf16 near-equal experts would otherwise swap places against the reference.
        logits = x.float() @ self.weight.float().t()
        if not self.is_hash:
            return route(logits, self.cfg, self.e_score_correction_bias)
        if token_ids is None:
            raise ValueError("a hash-routed MoE layer needs the token ids")
        return route(logits, self.cfg, hash_ids=self.tid2eid[token_ids])


class DeepseekExperts(nn.Module):
    """``mlp.experts``: the routed experts this rank holds, stacked for ``fused_experts`` (gate rows then up rows in
    w13). Without expert parallelism every expert, each split over the tensor-parallel ranks along its intermediate
    dimension. With it, whole experts in *slots*: a contiguous range of the ``num_slots`` slots per rank, slot s
    holding logical expert ``map.phy_to_log[s]`` (the identity unless load balancing placed replicas: see
    expert_map.py, and worker/eplb.py for the rebalancing). HF stores one module per expert; the model's loader
    hands each checkpoint tensor to ``load_expert``.

    ``mxfp4``: the checkpoint's MXFP4 experts stay packed as loaded (``layers/mxfp4.py``): ``_packed`` holds
    per-expert ``Mxfp4Weight`` views of stacked code/scale buffers from construction on, ``w13_weight`` /
    ``w2_weight`` are empty placeholders (the names the loader maps to). ``fp8_block``: the same for an FP8
    block-quantised checkpoint's experts (``Fp8Weight``, layers/fp8.py) on the CPU, unless they are split over
    tensor-parallel ranks or ``OPENINFER_FP8_WEIGHTS=dequantize`` (then ``self.fp8_block`` is None and the loader
    hands over dequantised tensors)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 swiglu_limit: float | None = None, mxfp4: bool = False,
                 fp8_block: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.ep, self.tp = get_ep_group(), get_tp_group()
        self.num_experts = num_experts
        self.map: ExpertMap | None = None
        self.count_load = False
        if self.ep.world_size > 1:
            eplb = get_eplb_settings()
            self.num_slots = num_experts + eplb.num_redundant_experts
            local = divide(self.num_slots, self.ep.world_size, "n_routed_experts + num_redundant_experts")
            self.first_slot = self.ep.rank_in_group * local
            self.shard = None  # whole experts
            if eplb.enabled or eplb.num_redundant_experts:
                # Initially expert e in slot e, the extra slots holding replicas of experts 0, 1, ...
                self.map = ExpertMap(torch.arange(self.num_slots) % num_experts, num_experts)
                self.count_load = eplb.enabled
        else:
            self.num_slots, local, self.first_slot = num_experts, num_experts, 0
            intermediate_size = divide(intermediate_size, self.tp.world_size, "moe_intermediate_size")
            self.shard = self.tp.rank_in_group * intermediate_size if self.tp.world_size > 1 else None
        self.num_local_slots = local
        self.intermediate_size = intermediate_size
        self.swiglu_limit = swiglu_limit
        self.mxfp4 = mxfp4
        dtype = torch.get_default_dtype()
        self.fp8_block = fp8_block if (fp8_block is not None and not mxfp4 and self.shard is None
                                       and fp8_block[1] % 8 == 0 and torch.empty(0).device.type == "cpu"
                                       and packed_fp8_enabled()) else None
        if self.fp8_block is not None:
            bk = self.fp8_block[1]
            self._packed = (stacked_fp8(local, 2 * intermediate_size, hidden_size, bk, dtype),
                            stacked_fp8(local, hidden_size, intermediate_size, bk, dtype))
            local_shape = ((0,), (0,))
        elif mxfp4:
            if self.shard is not None and (self.shard % MXFP4_BLOCK or intermediate_size % MXFP4_BLOCK):
                raise ValueError(f"MXFP4 experts split over tensor-parallel ranks need moe_intermediate_size / tp = "
                                 f"{intermediate_size} to be a multiple of {MXFP4_BLOCK} (one scale block)")
            self._packed = (stacked_mxfp4(local, 2 * intermediate_size, hidden_size, dtype),
                            stacked_mxfp4(local, hidden_size, intermediate_size, dtype))
            local_shape = ((0,), (0,))
        else:
            local_shape = ((local, 2 * intermediate_size, hidden_size), (local, hidden_size, intermediate_size))
        self.w13_weight = nn.Parameter(torch.empty(local_shape[0]), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(local_shape[1]), requires_grad=False)
        # Tokens routed since the last rebalance: per logical expert (what placement balances) and per slot (what
        # each rank actually served). Summed over ranks by the rebalancer.
        self.register_buffer("logical_load", torch.zeros(num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("slot_load", torch.zeros(self.num_slots, dtype=torch.long), persistent=False)

    _packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    # fp32 on the CPU, after prepack_cpu: (w13, w2) in the panel layout, the plain stacks emptied
    _panels: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def expert_ids(self) -> list[int]:
        """The global ids of the logical experts this rank holds (in at least one slot)."""
        slots = range(self.first_slot, self.first_slot + self.num_local_slots)
        if self.map is None:
            return list(slots)
        return sorted({int(self.map.phy_to_log[s]) for s in slots})

    @property
    def reduces_over_tp(self) -> bool:
        """Each rank's output is a partial sum the caller all-reduces over the tensor-parallel ranks: a slice of
        every expert (TP without EP), or under TP x EP the routed rows of this rank's share of the tokens."""
        return self.shard is not None or (self.ep.world_size > 1 and self.tp.world_size > 1)

    def _local_slots(self, expert: int) -> list[int]:
        if self.map is not None:
            return self.map.slots_of(expert, self.first_slot, self.num_local_slots)
        e = expert - self.first_slot
        return [e] if 0 <= e < self.num_local_slots else []

    @torch.no_grad()
    def load_expert(self, expert: int, part: int, tensor) -> bool:
        """Checkpoint tensor of global expert ``expert``: part 0 gate (w1), 1 up (w3), 2 down (w2), into every
        local slot holding it. Returns False for an expert only other ranks hold (nothing read)."""
        slots = self._local_slots(expert)
        if not slots:
            return False
        i = self.intermediate_size
        if self.mxfp4 or self.fp8_block is not None:
            return self._load_packed(expert, part, tensor, slots)
        if part == 2:
            src = tensor if self.shard is None else narrow(tensor, 1, self.shard, i)
        else:
            src = tensor if self.shard is None else narrow(tensor, 0, self.shard, i)
        src = materialize(src)
        for e in slots:
            dst = self.w2_weight[e] if part == 2 else self.w13_weight[e, part * i:(part + 1) * i]
            if tuple(src.shape) != tuple(dst.shape):
                raise WeightLoadError(f"expert {expert} part {part}: checkpoint slice has shape {tuple(src.shape)}, "
                                      f"the model expects {tuple(dst.shape)}")
            dst.copy_(src)
        return True

    def _load_packed(self, expert: int, part: int, tensor, slots: list[int]) -> bool:
        """An MXFP4 (``Mxfp4Tensor``) or FP8 (``Fp8Weight``) checkpoint matrix into the packed slots, as loaded."""
        kind, what = (Mxfp4Tensor, "MXFP4 experts (expert_dtype fp4)") if self.mxfp4 else (Fp8Weight, "FP8 experts")
        if not isinstance(tensor, kind):
            raise WeightLoadError(f"expert {expert} part {part}: the config declares {what} but the checkpoint "
                                  f"tensor is {getattr(tensor, 'dtype', None)}")
        i = self.intermediate_size
        if self.mxfp4 and self.shard is not None:  # rows of w1/w3, columns (whole scale blocks) of w2
            if part == 2:
                tensor = Mxfp4Tensor(tensor.packed[:, self.shard // 2:(self.shard + i) // 2],
                                     tensor.scale[:, self.shard // MXFP4_BLOCK:(self.shard + i) // MXFP4_BLOCK])
            else:
                tensor = Mxfp4Tensor(tensor.packed[self.shard:self.shard + i], tensor.scale[self.shard:self.shard + i])
        for e in slots:
            dst = self._packed[1][e] if part == 2 else self._packed[0][e]
            want = (dst.shape[0], dst.shape[1]) if part == 2 else (i, dst.shape[1])
            if tuple(tensor.shape) != want:
                raise WeightLoadError(f"expert {expert} part {part}: checkpoint slice has shape {tuple(tensor.shape)}, "
                                      f"the model expects {want}")
            try:
                dst.load_rows(0 if part == 2 else part * i, tensor)
            except ValueError as e:
                raise WeightLoadError(f"expert {expert} part {part}: {e}") from None
        return True

    @torch.no_grad()
    def quantize_weights(self, method: str) -> int:
        """``--quantization``: each expert's two matrices as low-bit ``QuantizedWeight``\\s in ``_packed`` (the
        per-expert loop of ``moe._looped_packed`` runs them); called by ``linear.quantize_linears`` after loading.
        Returns how many matrices."""
        w13, w2 = self.dense_weights()
        if w13.numel() == 0:
            return 0
        self._packed = ([QuantizedWeight.quantize(w13[e], method) for e in range(w13.shape[0])],
                        [QuantizedWeight.quantize(w2[e], method) for e in range(w2.shape[0])])
        self._panels = None
        self.w13_weight = nn.Parameter(w13.new_empty(0), requires_grad=False)
        self.w2_weight = nn.Parameter(w2.new_empty(0), requires_grad=False)
        return 2 * w13.shape[0]

    @torch.no_grad()
    def prepack_cpu(self) -> bool:
        """Plain stacks on the CPU in fp32, or bf16 without native bf16 (``cpu_ops.panels_enabled``; I a multiple of
        16): into the panel layout (``cpu_kernels/moe_panels.cpp`` says why), replacing them; called by
        ``linear.prepack_linears`` after loading. Returns whether it did."""
        if self._panels is not None:
            return True
        w13, w2 = self.w13_weight, self.w2_weight
        if (self._packed is not None or w13.dim() != 3 or w13.numel() == 0 or self.intermediate_size % cpu_ops.PANEL
                or not cpu_ops.panels_enabled(w13.device, w13.dtype)):
            return False
        self._panels = (cpu_ops.pack_panels(w13), cpu_ops.pack_panels(w2))
        self.w13_weight = nn.Parameter(w13.new_empty(0), requires_grad=False)
        self.w2_weight = nn.Parameter(w2.new_empty(0), requires_grad=False)
        return True

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) as plain tensors, packed or not (the reorder is exact both ways)."""
        if self._panels is not None:
            p13, p2 = self._panels
            return cpu_ops.unpack_panels(p13, 2 * self.intermediate_size), cpu_ops.unpack_panels(p2, p13.shape[-2])
        if self._packed is None:
            return self.w13_weight, self.w2_weight
        return tuple(torch.stack([w.to_dense() for w in ws]) for ws in self._packed)

    @torch.no_grad()
    def set_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Replace every local slot's weights (after a rebalance), as the plain row-major stacks, then in panels again
        if they were (``prepack_cpu``); never oneDNN's layout (moe.KERNEL_MAX_ROWS_PER_EXPERT says why)."""
        repack = self._panels is not None
        self._packed = self._panels = None
        self.w13_weight = nn.Parameter(w13, requires_grad=False)
        self.w2_weight = nn.Parameter(w2, requires_grad=False)
        if repack:
            self.prepack_cpu()

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """``out``: added onto in place (the shared experts' output), see ``fused_experts``."""
        if self.ep.world_size == 1:
            return fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.swiglu_limit,
                                 packed=self._packed, out=out, panels=self._panels)
        if self.tp.world_size == 1:
            return self._expert_parallel(x, topk_weights, topk_ids, out)
        # TP x EP: the replica's TP ranks hold the same tokens. Each sends only its contiguous share of them
        # through the all-to-all (so every (token, expert) pair is computed once in the deployment) and adds their
        # combined rows onto its rows of ``out``; zero elsewhere, so the caller's TP all-reduce of out (shared
        # experts' partial sums + routed rows) gives every rank the whole result. A share may be empty (fewer
        # tokens than ranks): the rank still joins the all-to-all.
        t, n, me = x.shape[0], self.tp.world_size, self.tp.rank_in_group
        lo, hi = t * me // n, t * (me + 1) // n
        dst = out if out is not None else torch.zeros_like(x)
        share = dst[lo:hi]
        routed = self._expert_parallel(x[lo:hi], topk_weights[lo:hi], topk_ids[lo:hi], share)
        if routed.data_ptr() != share.data_ptr() and hi > lo:
            share.copy_(routed)
        return dst

    def _expert_parallel(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         out: torch.Tensor | None) -> torch.Tensor:
        """Every (token, expert) pair of ``x`` to the rank holding the expert and back (expert_parallel.py)."""
        slots = topk_ids if self.map is None else self.map.to_slots(topk_ids)
        if self.count_load:
            md = peek_forward_context()
            if md is None or not md.is_dummy:
                self.logical_load += torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts)
                self.slot_load += torch.bincount(slots.reshape(-1), minlength=self.num_slots)
        y, order = expert_parallel_experts(
            x, slots, self.num_local_slots, self.ep,
            lambda rows, counts: experts_on_sorted_rows(rows, counts, self.w13_weight, self.w2_weight,
                                                        self.swiglu_limit, self._packed, self._panels))
        if self.map is not None:
            # Combine in the logical experts' order, as one process does (replicas only change where a pair ran).
            pairs = torch.empty_like(y)
            pairs[order] = y
            order = torch.argsort(topk_ids.reshape(-1), stable=True)
            y = pairs.index_select(0, order)
        return combine_experts(y.to(x.dtype), order, topk_weights, out)


class DeepseekMLP(nn.Module):
    """Dense SwiGLU MLP (dense layers, shared experts); HF's gate_proj/up_proj load into one fused matmul, split
    over the tensor-parallel ranks (``reduce_results=False``: the caller sums the partial results)."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None = None,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, reduce_results=reduce_results)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x), self.swiglu_limit))


class DeepseekMoE(nn.Module):
    """Routed experts + always-on shared experts (a dense MLP of n_shared_experts x moe_intermediate_size).
    ``swiglu_limit`` clamps routed and shared experts alike; ``hash_vocab_size`` makes the gate hash-routed.
    Under tensor parallelism both are partial sums over the ranks' slices, reduced once at the end."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, n_shared_experts: int,
                 cfg: RouterConfig, swiglu_limit: float | None = None,
                 hash_vocab_size: int | None = None, mxfp4_experts: bool = False,
                 fp8_block: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.gate = DeepseekTopkRouter(hidden_size, cfg, hash_vocab_size)
        self.experts = DeepseekExperts(cfg.n_routed_experts, hidden_size, moe_intermediate_size, swiglu_limit,
                                       mxfp4=mxfp4_experts, fp8_block=fp8_block)
        self.tp_reduce = self.experts.reduces_over_tp
        self.shared_experts = (
            DeepseekMLP(hidden_size, moe_intermediate_size * n_shared_experts, swiglu_limit,
                        reduce_results=not self.tp_reduce)
            if n_shared_experts else None)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        fused = self._block(x)
        if fused is not None:
            return fused
        topk_weights, topk_ids = self.gate(x, token_ids)
        # the routed outputs are combined straight onto the shared experts' output, in one pass
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        out = self.experts(x, topk_weights, topk_ids, out=shared)
        return self.experts.tp.all_reduce(out) if self.tp_reduce else out

    def _block(self, x: torch.Tensor) -> torch.Tensor | None:
        """This forward as one op (layers/decode_blocks.py, the same bits) on one rank with every matrix in the panel
        layout and a scored (not hash) router; None otherwise."""
        experts = self.experts
        if (self.gate.is_hash or experts._panels is None or experts.ep.world_size > 1 or self.tp_reduce
                or x.device.type != "cpu" or not decode_blocks.enabled()):
            return None
        shared = None
        if self.shared_experts is not None:
            mlp = self.shared_experts
            gate_up, down = decode_blocks.linear_panels(mlp.gate_up_proj), decode_blocks.linear_panels(mlp.down_proj)
            if gate_up is None or down is None or mlp.swiglu_limit != experts.swiglu_limit:
                return None
            shared = (gate_up, down, mlp.down_proj.in_features)
        return decode_blocks.moe_block(x, self.gate.weight, self.gate.e_score_correction_bias, self.gate.cfg, shared,
                                       experts._panels, experts.swiglu_limit)
