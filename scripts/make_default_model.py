#!/usr/bin/env python
"""Build openinfer's embedded default model (openinfer/assets/default-model/).

The engine loads this checkpoint when the user gives no --model, so the repo ships something that runs
out of the box and offline. It is a toy: a ~4M-parameter Llama trained for a few CPU minutes on English
that every Python install already carries (the reference-manual topics in pydoc_data plus stdlib
docstrings). Nothing is downloaded.

Regenerate (from the repo root; about 8 minutes on one CPU core):

    .venv/bin/python scripts/make_default_model.py --out openinfer/assets/default-model

Output is deterministic for a given --seed/--steps, Python stdlib (the corpus) and torch build, as long as
the --minutes wall cap is not hit; if it is, training stops early and the README records the real step count.
"""

import argparse
import ast
import math
import os
import random
import re
import sys
import sysconfig
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig,
                          LlamaForCausalLM, PreTrainedTokenizerFast)

BOS, EOS, PAD, END = "<s>", "</s>", "<pad>", "<|end|>"
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", END]
SPECIALS = [BOS, EOS, PAD] + CHAT_TOKENS  # ids 0..6, fixed order so ids never move between runs

# One role tag per turn, each turn closed by <|end|> (which generation_config also treats as EOS).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unsupported role: ' + message['role']) }}{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# stdlib parts that are not English prose worth learning from (tests, GUIs, vendored copies).
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip",
             "tkinter", "turtledemo", "__pycache__", "venv"}


def prose(doc: str) -> str:
    """Keep prose paragraphs, each reflowed onto one line; drop code, doctests, tables, reST underlines.
    The sources are hard-wrapped at ~72 columns, which makes newline the most frequent token and a
    briefly trained model then greedily emits nothing but newlines. Indented paragraphs are code/lists."""
    keep = []
    for para in re.split(r"\n\s*\n", doc.strip()):
        lines = [ln for ln in para.split("\n") if not re.fullmatch(r"\s*[-=*~^+#_]{3,}\s*", ln)]
        text = " ".join(ln.strip() for ln in lines)
        if not lines or lines[0][:1].isspace() or text[:1] in "+|>":
            continue
        if sum(c.isalpha() or c == " " for c in text) < 0.85 * len(text):  # symbol-heavy: code-ish
            continue
        keep.append(text)
    return "\n\n".join(keep)


def build_corpus() -> list[str]:
    """Python reference topics + stdlib docstrings, in a fixed order. Docstrings come from parsing the
    source with ast rather than importing modules, so no module side effects and no import failures."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    docs = [topics[k] for k in sorted(topics)]
    root = sysconfig.get_paths()["stdlib"]
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)  # sorted: os.walk order is fs-dependent
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            try:
                with open(os.path.join(d, f), encoding="utf-8") as fh:
                    tree = ast.parse(fh.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= 80:  # one-liners are mostly "Return x." noise
                        docs.append(doc)
    return [p for p in map(prose, docs) if len(p) >= 80]


def train_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style): no unknown tokens ever, and the ByteLevel decoder restores spaces."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(docs, trainer=trainer)
    # Llama convention: encoding prepends <s>. The chat template also starts with bos_token, and
    # apply_chat_template(tokenize=True) encodes with add_special_tokens=False, so no double BOS.
    tk.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tk.token_to_id(BOS))])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        extra_special_tokens=CHAT_TOKENS, model_max_length=1024,
        clean_up_tokenization_spaces=False)  # cleanup would break exact decode round-trips
    tok.chat_template = CHAT_TEMPLATE
    return tok


def token_stream(tok, docs: list[str]) -> torch.Tensor:
    """All docs as one stream: <s> doc </s> <s> doc </s> ... so the model learns document boundaries."""
    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(docs):  # the post-processor already prepends <s>
        ids += enc.ids + [tok.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def eval_loss(model, data: torch.Tensor, seq: int, batches: int = 4, bsz: int = 16) -> float:
    model.eval()
    n = (len(data) - 1) // seq
    windows = data[: n * seq].view(n, seq)[: batches * bsz]  # fixed windows: comparable across runs
    losses = [model(input_ids=w, labels=w).loss.item() for w in windows.split(bsz)]
    model.train()
    return sum(losses) / len(losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="openinfer/assets/default-model")
    ap.add_argument("--minutes", type=float, default=8.0, help="hard wall-clock cap on training")
    ap.add_argument("--steps", type=int, default=400, help="planned steps (~0.8 s each on a free core)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    # Small batch: with only a few hundred CPU steps, more updates beat bigger batches (equal-token
    # trials, val loss: batch 16 / lr 2e-3 -> 6.54, batch 8 / 3e-3 -> 6.22; on the cleaned corpus
    # batch 8 / 3e-3 -> 5.99, batch 4 / 3e-3 -> 5.86).
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)  # few steps: a tiny model tolerates a hot LR
    args = ap.parse_args()

    # One thread: the box is shared, and single-threaded CPU kernels make the run bit-reproducible.
    torch.set_num_threads(1)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    docs = build_corpus()
    print(f"corpus: {len(docs)} docs, {sum(map(len, docs)) / 1e6:.2f} MB of text")
    tok = train_tokenizer(docs, args.vocab)
    random.Random(args.seed).shuffle(docs)
    n_val = len(docs) // 50  # 2% of docs held out, to show the loss is not pure memorisation
    train_ids, val_ids = token_stream(tok, docs[n_val:]), token_stream(tok, docs[:n_val])
    print(f"tokens: train {len(train_ids)}, val {len(val_ids)}, vocab {len(tok)}")

    # MLP 640 instead of the usual ~8/3*hidden (688): keeps the bf16 asset folder under 8 MB.
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=640, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        tie_word_embeddings=True,  # the 4096x256 embedding is a quarter of the model; store it once
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        architectures=["LlamaForCausalLM"])
    model = LlamaForCausalLM(config)
    print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")

    # Weight decay on matrices only; decaying norm gains just fights the normalisation.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    warmup = max(1, args.steps // 10)
    # fp32 on purpose: without AVX512-BF16/AMX, bf16 autocast on CPU measured >10x slower here.
    t0, step, ema = time.time(), 0, None
    for step in range(args.steps):
        if time.time() - t0 > args.minutes * 60:
            print(f"wall cap of {args.minutes} min hit at step {step}; stopping early")
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, warmup)
        starts = torch.randint(0, len(train_ids) - args.seq, (args.batch,), generator=gen)
        x = torch.stack([train_ids[s: s + args.seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss  # HF shifts labels internally
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  ema {ema:.3f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {time.time() - t0:.0f}s", flush=True)
    else:
        step = args.steps
    train_min = (time.time() - t0) / 60
    val = eval_loss(model, val_ids, args.seq)
    print(f"done: {step} steps in {train_min:.1f} min, train loss (ema) {ema:.3f}, val loss {val:.3f}")

    # bf16 halves the asset (to ~7.6 MB) and is what the engine runs in anyway.
    os.makedirs(args.out, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(END)],
        pad_token_id=tok.pad_token_id, do_sample=True, temperature=0.8, top_p=0.95)
    model.to(torch.bfloat16).save_pretrained(args.out)  # transformers 5 always writes safetensors
    tok.save_pretrained(args.out)
    for f in os.listdir(args.out):  # the safetensors writer leaves 0600; package data should be readable
        os.chmod(os.path.join(args.out, f), 0o644)
    n_params, c = sum(p.numel() for p in model.parameters()), config
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(f"""# openinfer default model (toy)

A tiny Llama-architecture checkpoint that openinfer loads when no `--model` is given, so the engine
runs offline out of the box. **It is a toy**: it writes grammatical-ish English in the style of the
Python reference docs and knows nothing; do not expect answers, facts or instruction following.

- Architecture: LlamaForCausalLM, {n_params / 1e6:.2f}M params, hidden {c.hidden_size}, {c.num_hidden_layers}
  layers, {c.num_attention_heads} heads / {c.num_key_value_heads} KV heads (GQA), MLP {c.intermediate_size},
  context {c.max_position_embeddings}, tied embeddings, bfloat16.
- Tokenizer: byte-level BPE, vocab {len(tok)}, specials {", ".join(SPECIALS)};
  simple chat template (`<|role|>` ... `<|end|>` turns).
- Data: Python {sys.version.split()[0]}'s own `pydoc_data/topics.py` plus stdlib docstrings (no downloads),
  {len(train_ids)} training tokens.
- Training: {step} steps x {args.batch} x {args.seq} tokens, AdamW lr {args.lr} warmup+cosine,
  seed {args.seed}, {train_min:.1f} min on one CPU thread.
  Final train loss {ema:.2f} (EMA), held-out loss {val:.2f}.

Regenerate with `python scripts/make_default_model.py --out openinfer/assets/default-model`.
""")
    verify(args.out)


def verify(out: str) -> None:
    """Reload purely from disk with the stock transformers Auto classes, as a user would."""
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    text = "Hello  world, the list object's  sort() method.\n\tDone."
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text, "round-trip failed"
    print(repr(tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)))
    ids = tok("The list object", return_tensors="pt")
    outs = model.generate(**ids, max_new_tokens=40, do_sample=False)
    print("sample:", repr(tok.decode(outs[0], skip_special_tokens=True)))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"asset folder: {sorted(os.listdir(out))}, {size / 1e6:.2f} MB")
    print({k: v for k, v in model.config.to_dict().items() if k.endswith("token_id")})


if __name__ == "__main__":
    main()
