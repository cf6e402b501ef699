#!/usr/bin/env python
"""Train the DSpark drafter of a tiny DeepSeek-V4.1 checkpoint, so DSpark's acceptance figures mean something
(random draft blocks accept almost nothing).

    python scripts/train_tiny_dspark.py --out .bench/v41-dspark-tiny --max-minutes 12     # one thread
    python scripts/spec_acceptance.py --model .bench/v41-dspark-tiny --method mtp --k 1,2,3,4 --check-identity

Two stages on Python's standard-library top-level modules (char tokenizer, as the checkpoint maker writes):
1. the target (scripts/make_deepseek_v41_checkpoint.py's tiny model) is briefly trained as a language model,
   through openinfer's own paged forward (a throwaway cache bound per step): a random target continues text
   chaotically, its next token a hash of the context that no drafter generalises to (tried: self-distilling a
   random target reaches ~1% held-out top-1 while the training loss falls);
2. only the ``mtp.*`` draft blocks train (main_proj / main_norm, the block's attention, MoE and mHC, the final norm,
   the Markov head and the confidence head), the target frozen, on the target's own greedy continuations of
   prompts cut from the same modules (self-distillation, as drafters are usually trained: a drafter is only ever
   scored on agreeing with the target's greedy tokens). scripts/spec_acceptance.py measures on prompts from stdlib
   subpackages, which neither stage sees.

A drafter training example is one draft step as the proposer runs it (worker/proposers/dspark.py): after accepted
position a, the block reads the target features of a - W + 1 .. a (the streams entering
``dspark_target_layer_ids``, captured from the engine), runs on [golden = token a + 1, noise x (S - 1)] and position
i is scored against the target's token a + 2 + i, with the Markov correction teacher-forced on the previous true
token (loss: cross-entropy, plus the confidence head's binary cross-entropy against whether its position's argmax
was right).

The checkpoint is written unquantized (fp32 tensors, no ``quantization_config``, which the loader accepts) so the
trained weights are exactly what loads; tensor names are DeepInfer's (``layers.0.attn.wq_a.weight``,
``mtp.0.main_proj.weight``, ...): each tensor of the generated checkpoint is overwritten from the trained parameter
it loaded into.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

# Autograd runs through the torch code paths only: openinfer's C++ CPU kernels (RMSNorm, mHC, experts) have no
# backward, and oneDNN-prepacked linears replace the weights training updates. This process's engine uses the same
# fallbacks (the tiny model's data generation takes seconds).
os.environ["OPENINFER_CPU_KERNELS"] = "0"
os.environ["OPENINFER_CPU_PREPACK"] = "0"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from make_deepseek_v41_checkpoint import make_checkpoint  # noqa: E402
from train_tiny_mtp import corpus  # noqa: E402

from openinfer.models.deepseek_v4.loading import canonical_name  # noqa: E402



def optimizer_step(opt, sched, params, loss) -> float:
    """One clipped AdamW step on ``loss``; returns the loss value."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    return loss.item()

def prompts(text: str, n: int, chars: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - chars, (n,), generator=g).tolist()
    return [text[s:s + chars] for s in starts]


def target_data(llm, texts: list[str], gen_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Per prompt: (token ids [L], target features [L, targets*D], prompt length) of prompt + greedy continuation."""
    from openinfer import SamplingParams

    from openinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM  # noqa: F401 (type of the model below)

    model = llm.engine.core.executor.driver_worker.model
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=gen_tokens, ignore_eos=True), use_tqdm=False)
    data = []
    model.model.capture_dspark_features = True
    try:
        for out in outs:
            ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
            # one prefill of the whole sequence (prefix caching is off): features of every position
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
            feats = model.model.dspark_features
            assert feats.shape[0] == len(ids), (feats.shape, len(ids))
            data.append((torch.tensor(ids), feats.detach().clone(), len(out.prompt_token_ids)))
    finally:
        model.model.capture_dspark_features = False
    return data


class Examples:
    """Draft steps: anchor a (the accepted position) with all S labels inside the target's continuation."""

    def __init__(self, data, window: int, s: int) -> None:
        self.data, self.window, self.s = data, window, s
        self.anchors = [(j, a) for j, (ids, _, plen) in enumerate(data)
                        for a in range(max(plen - 2, window - 1), len(ids) - s - 1)]

    def batch(self, idx: list[int]):
        feats, ctx_pos, golden, labels = [], [], [], []
        for k in idx:
            j, a = self.anchors[k]
            ids, f, _ = self.data[j]
            pos = torch.arange(a - self.window + 1, a + 1)
            feats.append(f[pos])
            ctx_pos.append(pos)
            golden.append(ids[a + 1])
            labels.append(ids[a + 2:a + 2 + self.s])
        return torch.stack(feats), torch.stack(ctx_pos), torch.stack(golden), torch.stack(labels)


def encode(ckpt: Path, text: str) -> torch.Tensor:
    import transformers

    vocab = transformers.AutoTokenizer.from_pretrained(str(ckpt)).get_vocab()
    unk = vocab["<unk>"]
    return torch.tensor([vocab.get(c, unk) for c in text], dtype=torch.long)


def train_target(model, data: torch.Tensor, steps: int, batch: int, seq_len: int, lr: float, seconds: float,
                 seed: int) -> tuple[int, list[float]]:
    """Language-model training of the target through its paged forward: each step binds a fresh cache (so no
    autograd graph outlives its step) and runs ``batch`` whole sequences as one prefill step."""
    from openinfer.forward_context import AttentionMetadata, set_forward_context

    bs = 16
    specs = model.kv_cache_spec(bs, torch.float32)
    per_seq = {s.name: -(-seq_len // s.tokens_per_block(bs)) for s in specs}
    tables = {name: [list(range(i * n, (i + 1) * n)) for i in range(batch)] for name, n in per_seq.items()}
    params = [p for n, p in model.named_parameters()
              if not n.startswith("mtp.") and p.is_floating_point() and "bias" not in n.rsplit(".", 1)[-1]]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / 30) * 0.5 * (1 + math.cos(math.pi * min(k, steps) / steps)))
    gen = torch.Generator().manual_seed(seed)
    losses, t0, step = [], time.perf_counter(), 0
    for step in range(steps):
        if time.perf_counter() - t0 > seconds:
            print(f"target: stopping at step {step} (time budget)", flush=True)
            break
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen).tolist()
        seqs = torch.stack([data[s:s + seq_len + 1] for s in starts])
        model.bind_kv_cache({n: batch * k for n, k in per_seq.items()}, bs, torch.float32, torch.device("cpu"))
        md = AttentionMetadata.build([seq_len] * batch, [seq_len] * batch, tables,
                                     {s.name: s.tokens_per_block(bs) for s in specs}, bs, torch.device("cpu"))
        with set_forward_context(md):
            hidden = model(seqs[:, :-1].reshape(-1), md.positions)
        loss = F.cross_entropy(model.compute_logits(hidden).float(), seqs[:, 1:].reshape(-1))
        losses.append(optimizer_step(opt, sched, params, loss))
        if step % 25 == 0 or step == steps - 1:
            print(f"target step {step}: loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    else:
        step = steps
    model.free_kv_cache()
    for p in params:
        p.requires_grad_(False)
    return step, losses


def draft_loss(model, feats, ctx_pos, golden, labels):
    """-> (loss, top-1 accuracy per draft position [S]) with the Markov correction teacher-forced."""
    mtp = model.mtp
    b, w = ctx_pos.shape
    s = labels.shape[1]
    rotary = model.model.rotary["main"]
    keys = mtp.context_keys(feats.reshape(b * w, -1), ctx_pos.reshape(-1), rotary).view(b, w, len(mtp), -1)
    hidden = mtp.block_hidden(keys, ctx_pos, golden, model.model.embed_tokens, rotary, s)
    logits = model.lm_head(mtp[-1].norm(hidden)).float()
    prev = torch.cat([golden[:, None], labels[:, :-1]], dim=1)
    ce, bce, acc = 0.0, 0.0, []
    for i in range(s):
        step, conf = mtp.corrected(hidden[:, i], logits[:, i], prev[:, i])
        ce = ce + F.cross_entropy(step, labels[:, i])
        right = (step.argmax(-1) == labels[:, i]).float()
        bce = bce + F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), right)
        acc.append(right.mean().item())
    return (ce + 0.1 * bce) / s, acc


def save_trained(model, ckpt: Path, prefix: str = "") -> int:
    """Overwrite every checkpoint tensor whose name starts with ``prefix`` with the trained parameter it loaded
    into (the loader's own name mapping, inverted per tensor). Returns how many were written."""
    from safetensors.torch import load_file, save_file

    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    params = dict(model.named_parameters())
    n = 0
    for name, old in tensors.items():
        if not name.startswith(prefix):
            continue
        pname, shard = canonical_name(name)
        p = params[pname].detach()
        if shard is not None:
            expert, part = shard
            if expert is None:  # shared expert's fused gate_up: gate rows then up rows
                half = p.shape[0] // 2
                p = p[part * half:(part + 1) * half]
            elif part == 2:
                p = p[expert]
            else:
                half = p.shape[1] // 2
                p = p[expert, part * half:(part + 1) * half]
        if tuple(p.shape) != tuple(old.shape):
            raise RuntimeError(f"{name}: trained parameter {pname} has shape {tuple(p.shape)}, the checkpoint "
                               f"{tuple(old.shape)}")
        tensors[name] = p.to(old.dtype).contiguous().clone()
        n += 1
    save_file(tensors, str(path))
    return n


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=800, help="drafter training steps")
    ap.add_argument("--target-steps", type=int, default=300, help="target language-model steps (0: random target)")
    ap.add_argument("--target-batch", type=int, default=16)
    ap.add_argument("--target-seq-len", type=int, default=128)
    ap.add_argument("--target-lr", type=float, default=3e-3)
    ap.add_argument("--max-minutes", type=float, default=12.0,
                    help="stop training after this long, both stages together (the target gets at most half)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--num-seqs", type=int, default=192, help="target continuations to train on")
    ap.add_argument("--prompt-chars", type=int, default=48)
    ap.add_argument("--gen-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from openinfer import LLM

    out = Path(args.out)
    make_checkpoint(out, "tiny", seed=args.seed, quantize=False)
    cfg = json.loads((out / "config.json").read_text())["text_config"]
    window, s = cfg["sliding_window"], cfg["dspark_block_size"]
    t_start = t0 = time.perf_counter()
    text = corpus(2_000_000)
    llm = LLM(str(out), dtype="float32", enable_prefix_caching=False, max_model_len=1024)
    target_steps, target_losses = 0, []
    if args.target_steps:
        model = llm.engine.core.executor.driver_worker.model
        del llm  # its cache is rebound for training; a fresh engine loads the trained target below
        target_steps, target_losses = train_target(
            model, encode(out, text), args.target_steps, args.target_batch, args.target_seq_len, args.target_lr,
            args.max_minutes * 30, args.seed)
        print(f"target: {target_steps} steps, loss {target_losses[0]:.3f} -> {target_losses[-1]:.3f}", flush=True)
        save_trained(model, out)
        del model
        llm = LLM(str(out), dtype="float32", enable_prefix_caching=False, max_model_len=1024)
    t0 = time.perf_counter()
    data = target_data(llm, prompts(text, args.num_seqs, args.prompt_chars, args.seed), args.gen_tokens)
    model = llm.engine.core.executor.driver_worker.model
    del llm  # the model object stays: its drafter is what trains
    held = Examples(data[:max(1, len(data) // 8)], window, s)
    train = Examples(data[len(held.data):], window, s)
    distinct = len({int(t) for ids, _, plen in data for t in ids[plen:]})
    print(f"data: {len(data)} target continuations ({distinct} distinct tokens generated), {len(train.anchors)} "
          f"train / {len(held.anchors)} held-out draft steps ({time.perf_counter() - t0:.0f} s)", flush=True)

    # Prepacked linears hold oneDNN copies of their weights; training needs the plain ones.
    for m in model.mtp.modules():
        if getattr(m, "_packed", None) is not None:
            raise RuntimeError("the drafter's weights are prepacked; train with OPENINFER_CPU_PREPACK=0")
    for prm in model.parameters():
        prm.requires_grad_(False)
    params = list(model.mtp.parameters())
    for prm in params:
        prm.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(k, args.steps) / args.steps)))
    gen = torch.Generator().manual_seed(args.seed)
    held_idx = list(range(min(len(held.anchors), 512)))

    def held_out() -> tuple[float, list[float]]:
        with torch.no_grad():
            loss, acc = draft_loss(model, *held.batch(held_idx))
        return float(loss), acc

    first_loss, first_acc = held_out()
    print(f"held-out before: loss {first_loss:.3f}, top-1 per position "
          f"{', '.join(f'{a:.1%}' for a in first_acc)}", flush=True)
    t1, losses, step = time.perf_counter(), [], 0
    for step in range(args.steps):
        if time.perf_counter() - t_start > args.max_minutes * 60:
            print(f"stopping at step {step}: --max-minutes {args.max_minutes} reached", flush=True)
            break
        idx = torch.randint(0, len(train.anchors), (args.batch,), generator=gen).tolist()
        loss, _ = draft_loss(model, *train.batch(idx))
        losses.append(optimizer_step(opt, sched, params, loss))
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {losses[-1]:.3f} ({time.perf_counter() - t1:.0f} s)", flush=True)
    else:
        step = args.steps
    last_loss, last_acc = held_out()
    print(f"held-out after {step} steps: loss {last_loss:.3f}, top-1 per position "
          f"{', '.join(f'{a:.1%}' for a in last_acc)}", flush=True)
    n = save_trained(model, out, "mtp.")
    print(f"wrote {n} trained mtp.* tensors into {out}", flush=True)
    summary = {"target_steps": target_steps, "target_losses": target_losses, "steps": step, "held_out_loss_before": first_loss, "held_out_loss_after": last_loss,
               "held_out_top1_before": first_acc, "held_out_top1_after": last_acc, "train_losses": losses}
    (out / "dspark_training.json").write_text(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
