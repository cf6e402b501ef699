#!/usr/bin/env python
"""Train a tiny DeepSeek-V3-shaped model and its MTP layer on Python's own standard-library sources, so speculative
decoding's acceptance figures mean something (random MTP weights accept nothing).

    python scripts/train_tiny_mtp.py --out .bench/dsv3-mtp-tiny            # ~3-5 minutes on 2 cores
    openinfer generate --model .bench/dsv3-mtp-tiny --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'

The model is transformers' DeepseekV3ForCausalLM (MLA, DeepSeekMoE) with a character tokenizer. The MTP layer is
trained jointly as DeepSeek-V3 did (report section 2.2): at position p it combines the main model's final hidden
state at p with the embedding of token p + 1 and predicts token p + 2; loss = main + 0.3 x MTP. Embedding and output
head are shared with the main model, as in the report. The checkpoint is written in DeepSeek's HF layout: the MTP
block as ``model.layers.{num_hidden_layers}.*`` with its enorm / hnorm / eh_proj and copies of the embedding
(``embed_tokens``) and head (``shared_head.head``), ``num_nextn_predict_layers: 1``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from openinfer.utils.char_tokenizer import write_char_tokenizer  # noqa: E402

VOCAB = 128


def config_dict(layers: int, hidden: int) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1,
                q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                n_shared_experts=1, routed_scaling_factor=1.0, norm_topk_prob=True, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=0, eos_token_id=1,
                tie_word_embeddings=False, rms_norm_eps=1e-6)


def corpus(max_bytes: int) -> str:
    """The standard library's own .py files (they ship with every Python), printable ASCII only."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for f in sorted(stdlib.glob("*.py")):
        text = "".join(c for c in f.read_text(errors="ignore") if c.isascii() and (c.isprintable() or c in "\n\t"))
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return "".join(parts)


class MTPHead(nn.Module):
    def __init__(self, hidden: int, block: nn.Module, norm_cls) -> None:
        super().__init__()
        self.enorm, self.hnorm = norm_cls(hidden, eps=1e-6), norm_cls(hidden, eps=1e-6)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.norm = norm_cls(hidden, eps=1e-6)  # shared_head.norm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--corpus-mb", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import transformers
    from safetensors.torch import save_file
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    write_char_tokenizer(out, VOCAB)
    vocab = transformers.AutoTokenizer.from_pretrained(str(out)).get_vocab()
    text = corpus(int(args.corpus_mb * 1e6))
    unk = vocab["<unk>"]
    data = torch.tensor([vocab.get(c, unk) for c in text], dtype=torch.long)
    split = int(0.95 * len(data))
    train, held = data[:split], data[split:]
    print(f"corpus: {len(text) / 1e6:.2f} MB of standard-library source, {len(train)} train / {len(held)} held-out "
          f"tokens", flush=True)

    # One more decoder layer than the main model: the last is the MTP block (its checkpoint name follows).
    cfg = transformers.DeepseekV3Config(**config_dict(args.layers + 1, args.hidden))
    cfg._attn_implementation = "sdpa"  # causal without an explicit mask
    model = transformers.DeepseekV3ForCausalLM(cfg).float().train()
    mtp = MTPHead(args.hidden, model.model.layers[args.layers], hf.DeepseekV3RMSNorm)
    params = [p for n, p in model.named_parameters() if f"layers.{args.layers}." not in n] + list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))

    def losses(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, t = batch[:, :-1], batch.shape[1] - 1
        pos = torch.arange(t)[None].expand(ids.shape[0], -1)
        x = model.model.embed_tokens(ids)
        pe = model.model.rotary_emb(x, pos)
        for layer in model.model.layers[:args.layers]:
            x = layer(x, position_ids=pos, position_embeddings=pe)
        h = model.model.norm(x)  # what the engine hands the MTP layer: the final, normed hidden state
        main = F.cross_entropy(model.lm_head(h).flatten(0, 1), batch[:, 1:].flatten())
        # MTP at position p: h_p and token p + 1 -> token p + 2.
        e = model.model.embed_tokens(batch[:, 1:t])
        m = mtp.eh_proj(torch.cat([mtp.enorm(e), mtp.hnorm(h[:, :t - 1])], dim=-1))
        pe2 = (pe[0][:, :t - 1], pe[1][:, :t - 1])
        m = mtp.block(m, position_ids=pos[:, :t - 1], position_embeddings=pe2)
        logits = model.lm_head(mtp.norm(m))
        target = batch[:, 2:]
        mtp_loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        acc = (logits.argmax(-1) == target).float().mean()
        return main, mtp_loss, acc

    def sample(src: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(src) - args.seq_len - 2, (n,), generator=gen)
        return torch.stack([src[s:s + args.seq_len + 1] for s in starts.tolist()])

    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    for step in range(args.steps):
        main, mtp_loss, _ = losses(sample(train, args.batch, gen))
        loss = main + 0.3 * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}: main {main.item():.3f}, mtp {mtp_loss.item():.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    model.eval()
    with torch.no_grad():
        main, mtp_loss, acc = losses(sample(held, 64, torch.Generator().manual_seed(1)))
    print(f"held-out: main loss {main.item():.3f}, MTP loss {mtp_loss.item():.3f}, MTP top-1 {acc.item():.1%}")

    # The checkpoint: transformers writes the main model and the MTP block under model.layers.{layers}; the MTP
    # layer's own tensors go in beside them, and config.json says the last layer is the MTP layer.
    model.save_pretrained(str(out))
    p = f"model.layers.{args.layers}."
    extra = {p + "enorm.weight": mtp.enorm.weight, p + "hnorm.weight": mtp.hnorm.weight,
             p + "eh_proj.weight": mtp.eh_proj.weight, p + "shared_head.norm.weight": mtp.norm.weight,
             p + "embed_tokens.weight": model.model.embed_tokens.weight, p + "shared_head.head.weight":
             model.lm_head.weight}
    save_file({k: v.detach().contiguous().clone() for k, v in extra.items()}, str(out / "mtp.safetensors"),
              metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.is_file():
        idx = json.loads(index.read_text())
        idx["weight_map"].update(dict.fromkeys(extra, "mtp.safetensors"))
        index.write_text(json.dumps(idx, indent=2))
    conf = json.loads((out / "config.json").read_text())
    conf.update(num_hidden_layers=args.layers, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True))
    print(f"wrote {out}: DeepseekV3ForCausalLM, {args.layers} layers + 1 MTP layer, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")


if __name__ == "__main__":
    main()
