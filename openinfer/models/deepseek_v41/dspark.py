"""DSpark drafter (spec §7.8, DeepInfer ``mtp/dflash.py`` + ``v4_modules/heads.py``): the
``num_nextn_predict_layers`` draft blocks of V4.1; speculative decoding drives them through
``worker/proposers/dspark.py`` (context keys paged per token, ``propose_over_keys`` per step).

Context: for every target token p, the target layers' attention inputs (the mHC streams entering each of
``dspark_target_layer_ids``, averaged over the streams) are concatenated and projected once:
  main_p = main_norm(main_proj(concat_l mean_j X_l[p, j]))                       (mtp.0.main_proj / main_norm)
and every draft block b keys its sliding window with them: k_{b,p} = RoPE(kv_norm_b(wkv_b(main_p)), p).
Draft step after the target accepted position a (golden = the token the target just sampled, at a + 1):
  the block's inputs are embed([golden, noise x (block_size - 1)]) at positions a+1 .. a+block_size; each draft
  block is a shifted-mHC decoder layer whose queries attend the window keys k_{b, a-W+1..a} plus all the block's
  own keys (bidirectional inside the block), with sinks, then its MoE; the last block's pre mix collapses the
  streams to h_i (no hc_head), and
  logits_i = lm_head(norm(h_i)) + markov_head(markov_embed[t_{i-1}])            (Markov correction, t_{-1} = golden)
  conf_i   = sigmoid([h_i, markov_embed[t_{i-1}]] . confidence_w / T)           (predicted acceptance)
  t_i      = argmax logits_i  (greedy), or a draw from the request's sampling distribution of logits_i when it
             samples (``draw``: DeepInfer's sample_drafts runs the request's own sampling on each position; the
             Markov term of the next position then reads the drawn token)
Draft position i proposes the token at a + 2 + i.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from openinfer.layers.linear import CheckpointLinear
from openinfer.layers.norm import RMSNorm
from openinfer.layers.rotary import apply_interleaved
from openinfer.models.deepseek_v4.attention import sink_attention
from openinfer.models.deepseek_v41.attention import Attention
from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.deepseek_v41.hc import ShiftedHyperConnection, apply_pre, first_pre, hc_post
from openinfer.models.deepseek_v41.moe import MoE

# Picks one draft position's tokens: (Markov-corrected logits [B, V], position i) -> tokens [B]
Draw = Callable[[torch.Tensor, int], torch.Tensor]


def target_features(streams: list[torch.Tensor]) -> torch.Tensor:
    """The mHC streams [T, n, D] entering each target layer -> [T, targets * D] (mean over the streams)."""
    return torch.cat([X.float().mean(dim=1).to(X.dtype) for X in streams], dim=-1)


def draft_positions(accepted: torch.Tensor, window: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted positions a [B] -> (context positions [B, window]: a-window+1 .. a, -1 before the sequence start;
    draft positions [B, s]: a+1 .. a+s). The block's keys are the context's then its own, DeepInfer's kv_index
    layout (get_fused_dflash_get_input: window + block positions from a - window + 1)."""
    ctx = accepted[:, None] + torch.arange(-window + 1, 1, device=accepted.device)
    return ctx.masked_fill(ctx < 0, -1), accepted[:, None] + 1 + torch.arange(s, device=accepted.device)


class DraftAttention(Attention):
    """Sliding-window attention (main RoPE) over the projected context keys plus the draft block's own keys."""

    def context_keys(self, main: torch.Tensor, positions: torch.Tensor, rotary) -> torch.Tensor:
        """main [N, D] projected context at ``positions`` [N] -> this block's roped keys [N, d]. A key depends only
        on its own token's features and position, so a serving engine computes it once, when the target computes
        the token, and pages it (DeepInfer's ``update_main_cache``)."""
        cos, sin = rotary._compute(positions.clamp(min=0))
        return apply_interleaved(self.kv_norm(self.kv_proj(main)), cos, sin)

    def draft(self, x: torch.Tensor, main: torch.Tensor, ctx_pos: torch.Tensor, draft_pos: torch.Tensor,
              rotary) -> torch.Tensor:
        """x [B*S, D] draft inputs; main [B, W, D] projected context (rows with ctx_pos < 0 are padding);
        ctx_pos [B, W]; draft_pos [B, S] -> [B*S, D]."""
        b, w = ctx_pos.shape
        keys = self.context_keys(main.reshape(b * w, -1), ctx_pos.reshape(-1), rotary).view(b, w, -1)
        return self.draft_over_keys(x, keys, ctx_pos >= 0, draft_pos, rotary)

    def draft_over_keys(self, x: torch.Tensor, ctx_keys: torch.Tensor, ctx_valid: torch.Tensor,
                        draft_pos: torch.Tensor, rotary) -> torch.Tensor:
        """As ``draft``, over already projected context keys [B, W, d] (ctx_valid [B, W])."""
        b, s = draft_pos.shape
        cos, sin = rotary.cos_sin(draft_pos.reshape(-1))
        q, _, kv = self.project(x, cos, sin)
        keys = torch.cat([ctx_keys.to(kv.dtype), kv.view(b, s, -1)], dim=1)  # [B, W + S, d]
        valid = torch.cat([ctx_valid, torch.ones(b, s, dtype=torch.bool, device=x.device)], dim=1)
        keys = keys.repeat_interleave(s, dim=0)
        valid = valid.repeat_interleave(s, dim=0)
        return self.project_out(sink_attention(q, keys, valid, self.sinks, self.scale), cos, sin)


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.zeros(vocab_size, rank), requires_grad=False)
        self.head = CheckpointLinear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = CheckpointLinear(dim, 1, bias=False)


class DraftBlock(nn.Module):
    """One ``mtp.{i}`` block; the first holds main_proj / main_norm, the last the heads."""

    def __init__(self, cfg: DeepseekV41Config, index: int) -> None:
        super().__init__()
        h, eps, ds = cfg.hidden_size, cfg.rms_norm_eps, cfg.dspark
        self.self_attn = DraftAttention(cfg, cfg.num_hidden_layers + index)
        self.mlp = MoE(cfg, ds.n_routed_experts, ds.num_experts_per_tok)
        self.input_layernorm = RMSNorm(h, eps, torch.float32)
        self.post_attention_layernorm = RMSNorm(h, eps, torch.float32)
        self.attn_hc = ShiftedHyperConnection(cfg.hc_mult, h, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.ffn_hc = ShiftedHyperConnection(cfg.hc_mult, h, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        if index == 0:
            self.main_proj = CheckpointLinear(len(ds.target_layer_ids) * h, h, bias=False)
            self.main_norm = RMSNorm(h, eps, torch.float32)
        if index == cfg.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(h, eps, torch.float32)
            self.markov_head = MarkovHead(cfg.vocab_size, ds.markov_rank)
            self.confidence_head = ConfidenceHead(h + ds.markov_rank)


class DSparkDrafter(nn.ModuleList):
    """The draft blocks, held by the model as ``mtp`` so the checkpoint's ``mtp.{i}.*`` names map directly."""

    def __init__(self, cfg: DeepseekV41Config) -> None:
        super().__init__(DraftBlock(cfg, i) for i in range(cfg.num_nextn_predict_layers))
        self.cfg = cfg

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        first = self[0]
        return first.main_norm(first.main_proj(features))

    def context_keys(self, features: torch.Tensor, positions: torch.Tensor, rotary) -> torch.Tensor:
        """features [N, targets*D] of tokens at ``positions`` [N] -> every block's context keys [N, blocks, d]."""
        main = self.project_context(features)
        return torch.stack([blk.self_attn.context_keys(main, positions, rotary) for blk in self], dim=1)

    @torch.no_grad()
    def propose(self, features: torch.Tensor, ctx_pos: torch.Tensor, golden: torch.Tensor, embed: nn.Module,
                lm_head: nn.Module, rotary, temperature: float = 1.0,
                block_size: int | None = None, draw: Draw | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, W, targets*D] of the last W accepted tokens (ctx_pos [B, W], -1 = none; the last column
        is the accepted position a); golden [B] -> (draft tokens [B, S], confidences [B, S]), S = ``block_size``
        (default the checkpoint's dspark_block_size); ``draw`` picks each position's tokens (default argmax)."""
        b, w = ctx_pos.shape
        keys = self.context_keys(features.reshape(b * w, -1), ctx_pos.reshape(-1), rotary).view(b, w, len(self), -1)
        return self.propose_over_keys(keys, ctx_pos, golden, embed, lm_head, rotary, temperature, block_size, draw)

    @torch.no_grad()
    def propose_over_keys(self, keys: torch.Tensor, ctx_pos: torch.Tensor, golden: torch.Tensor, embed: nn.Module,
                          lm_head: nn.Module, rotary, temperature: float = 1.0,
                          block_size: int | None = None, draw: Draw | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``propose``, over the context keys [B, W, blocks, d] (``context_keys``) of positions ctx_pos. A
        serving engine runs the blocks with S = its number of speculative tokens, as DeepInfer does."""
        hidden = self.block_hidden(keys, ctx_pos, golden, embed, rotary, block_size or self.cfg.dspark.block_size)
        return self.sample(hidden, golden, lm_head, temperature, draw)

    def block_hidden(self, keys: torch.Tensor, ctx_pos: torch.Tensor, golden: torch.Tensor, embed: nn.Module,
                     rotary, s: int) -> torch.Tensor:
        """The blocks' output streams collapsed by the last pre, [B, S, D] before the norm (no grad mode of its
        own: scripts/train_tiny_dspark.py trains through it)."""
        cfg, ds = self.cfg, self.cfg.dspark
        b = golden.shape[0]
        valid = ctx_pos >= 0
        draft_pos = draft_positions(ctx_pos[:, -1], 0, s)[1]
        ids = torch.full((b, s), ds.noise_token_id, dtype=torch.long, device=golden.device)
        ids[:, 0] = golden
        x = embed(ids.reshape(-1))
        X = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = first_pre(x.shape[0], cfg.hc_mult, x.device)
        for i, blk in enumerate(self):
            nxt, post, comb = blk.attn_hc.mixes(X)
            y = blk.self_attn.draft_over_keys(blk.input_layernorm(apply_pre(pre, X)), keys[:, :, i], valid,
                                              draft_pos, rotary)
            X, pre = hc_post(y, X, post, comb), nxt
            nxt, post, comb = blk.ffn_hc.mixes(X)
            X, pre = hc_post(blk.mlp(blk.post_attention_layernorm(apply_pre(pre, X))), X, post, comb), nxt
        return apply_pre(pre, X).view(b, s, -1)

    def corrected(self, hidden: torch.Tensor, logits: torch.Tensor, prev: torch.Tensor,
                  temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft position: head logits [B, V] (lm_head(norm(h))) and the previous token [B] -> (logits with the
        Markov correction, confidence [B])."""
        last = self[-1]
        m = last.markov_head.embed.weight[prev]
        step = logits + last.markov_head.head(m).float()
        z = last.confidence_head.proj(torch.cat([hidden, m.to(hidden.dtype)], dim=-1)).float()
        return step, torch.sigmoid((z[:, 0] / temperature).clamp(-60, 60))

    def sample(self, hidden: torch.Tensor, golden: torch.Tensor, lm_head: nn.Module,
               temperature: float = 1.0, draw: Draw | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [B, S, D] before the norm -> drafts with the Markov correction (argmax, or ``draw(logits, i)``
        at each position i) and their confidences."""
        last = self[-1]
        logits = lm_head(last.norm(hidden)).float()
        prev, tokens, confidence = golden, [], []
        for i in range(hidden.shape[1]):
            step, conf = self.corrected(hidden[:, i], logits[:, i], prev, temperature)
            confidence.append(conf)
            prev = step.argmax(dim=-1) if draw is None else draw(step, i)
            tokens.append(prev)
        return torch.stack(tokens, dim=1), torch.stack(confidence, dim=1)
