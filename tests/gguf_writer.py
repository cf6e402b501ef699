"""Tiny GGUF files written by the tests themselves, the way llama.cpp's converter writes them, plus the HF-format
reference checkpoint holding exactly the weights the GGUF file encodes (its blocks dequantised by llama.cpp's own
``gguf.quants.dequantize``), so transformers runs the same model the file holds.

Weights are stored as llama.cpp stores them: names ``blk.N.attn_q.weight`` ..., a ``llama`` model's q / k rows
permuted for interleaved RoPE (``convert_hf_to_gguf.py`` ``LlamaModel.permute``, written here from its definition),
Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 quantized by ``gguf.quants.quantize`` (llama.cpp's reference quantizers), and
Q4_K / Q5_K / Q6_K (which gguf-py cannot quantize) as random blocks with their fp16 super-block scales set so the
weights have the spread of the other tiny checkpoints. The tokenizer is a byte-level BPE (``gpt2`` model, every byte
a token, a few merges) with control tokens and a chat template.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n"]
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
# byte offsets of the fp16 super-block scales in a K-quant block (ggml-common.h block_q4_K / q5_K / q6_K)
_K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# dmin / d for the mins, so a block's mean sits near zero (q averages 7.5 / 15.5 for 4 / 5 bits)
_K_MIN_RATIO = {"Q4_K": 7.5, "Q5_K": 15.5}


def byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


def vocab() -> list[str]:
    return byte_tokens() + [m.replace(" ", "") for m in MERGES] + SPECIALS


def spm_vocab(merges: int = 600) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary (see ``_spm_vocab``), learned once per process: write_gguf asks twice."""
    tokens, scores, types = _spm_vocab(merges)
    return list(tokens), list(scores), list(types)


@functools.cache
def _spm_vocab(merges: int) -> tuple[tuple[str, ...], tuple[float, ...], tuple[int, ...]]:
    """A SentencePiece-style (``llama`` tokenizer model) vocabulary, deterministic: <unk> <s> </s>, the 256 byte
    fallbacks <0xNN>, every character of the Factbook text (spaces as "▁"), then ``merges`` BPE merges learned on
    that text, each scored -order so the earlier merge wins. Returns (tokens, scores, token types)."""
    import collections

    import gguf

    text = (Path(__file__).parent / "data" / "factbook_backgrounds.txt").read_text()
    words = collections.Counter("▁" + w for w in text.split())
    chars = sorted({c for w in words for c in w})
    seqs = {w: list(w) for w in words}
    # Pair counts kept up to date as words change (recounting every word per merge took a minute on 2 cores);
    # the merges are the same as a full recount's: ties still go to the larger pair.
    pairs: collections.Counter = collections.Counter()
    holders: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    for w, n in words.items():
        s = seqs[w]
        for pair in zip(s, s[1:]):
            pairs[pair] += n
            holders[pair].add(w)
    learned: list[str] = []
    for _ in range(merges):
        if not pairs:
            break
        (a, b), _n = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        learned.append(a + b)
        for w in list(holders[a, b]):
            s, out, i, n = seqs[w], [], 0, words[w]
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            for pair in zip(s, s[1:]):
                pairs[pair] -= n
                if pairs[pair] == 0:
                    del pairs[pair]
                holders[pair].discard(w)
            for pair in zip(out, out[1:]):
                pairs[pair] += n
                holders[pair].add(w)
            seqs[w] = out
    T = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + learned
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-1e4 - i for i in range(len(chars))] + [-float(i) for i in
                                                                                     range(len(learned))]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL] * (len(chars) + len(learned))
    return tuple(tokens), tuple(scores), tuple(int(t) for t in types)


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q / k permutation (HF rotate-half order -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator, std: float = 0.08) -> np.ndarray:
    """uint8 [rows, cols / 256 * type_size] of random K-quant blocks whose dequantised weights have about ``std``."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    nblocks = rows * cols // block
    raw = rng.integers(0, 256, size=(nblocks, size), dtype=np.uint8)

    def set_scales(d: np.ndarray) -> None:
        offs = _K_SCALE_OFFSETS[qtype]
        raw[:, offs[0]:offs[0] + 2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8).reshape(-1, 2)
        if len(offs) > 1:
            dmin = (d * _K_MIN_RATIO[qtype]).astype(np.float16)
            raw[:, offs[1]:offs[1] + 2] = dmin.reshape(-1, 1).view(np.uint8).reshape(-1, 2)

    jitter = rng.uniform(0.5, 1.5, size=nblocks)
    set_scales(jitter)
    w = gguf.quants.dequantize(raw.reshape(rows, -1), t)
    set_scales(jitter * std / float(w.std()))
    return raw.reshape(rows, -1)


def _encode(name: str, w: np.ndarray, qtype: str, rng: np.random.Generator, heads: int | None):
    """(bytes or float array to write, GGUF type, the weight it holds in HF row order)."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32" or w.ndim == 1:
        data = w.astype(np.float32)
        held = data
        t = gguf.GGMLQuantizationType.F32
        if heads is not None and w.ndim == 2:
            data = llama_permute(data, heads)
        return data, t, held
    if qtype in K_TYPES:
        packed = random_k_blocks(qtype, w.shape[0], w.shape[1], rng)
    else:
        packed = gguf.quants.quantize(w.astype(np.float32), t)
    held = gguf.quants.dequantize(packed, t).astype(np.float32).reshape(w.shape)
    if heads is not None:
        packed = llama_permute(packed, heads)
    return packed, t, held


def write_gguf(dir_path: str | Path, arch: str = "llama", qtype: str = "Q8_0", types: dict[str, str] | None = None,
               seed: int = 0, tie: bool = True, hidden: int = 64, intermediate: int = 128, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, head_dim: int | None = None,
               omit_tokenizer: bool = False, tokenizer: str = "bpe") -> tuple[Path, Path]:
    """Write ``model.gguf`` (plus ``hf/``, the HF checkpoint of the same weights) under ``dir_path``; returns
    (the GGUF file, the HF folder). ``tokenizer``: "bpe" (byte-level, ``gpt2``) or "spm" (``spm_vocab``, the
    ``llama`` SentencePiece model). ``types`` overrides the type per GGUF tensor kind (``attn_v``, ``ffn_down``,
    ``token_embd`` ...), as a Q4_K_M file mixes Q4_K and Q6_K. Norms are F32, as llama.cpp keeps them."""
    import gguf
    import transformers

    dir_path = Path(dir_path)
    dir_path.mkdir(parents=True, exist_ok=True)
    types = types or {}
    toks = vocab() if tokenizer == "bpe" else spm_vocab()[0]
    head_dim = head_dim or hidden // heads
    cls_cfg, cls_model = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    cfg = cls_cfg(vocab_size=len(toks), hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, max_position_embeddings=512, tie_word_embeddings=tie, rms_norm_eps=1e-6,
                  rope_theta=10000.0, bos_token_id=len(toks) - 2, eos_token_id=len(toks) - 1)
    torch.manual_seed(seed)
    model = cls_model(cfg).float()
    rng = np.random.default_rng(seed)
    state = {}
    for name, p in model.state_dict().items():
        if "norm" in name:
            state[name] = (1.0 + 0.1 * torch.randn_like(p)).numpy()
        elif "bias" in name:
            state[name] = (0.1 * torch.randn_like(p)).numpy()
        else:
            state[name] = (0.08 * torch.randn_like(p)).numpy()

    writer = gguf.GGUFWriter(str(dir_path / "model.gguf"), arch)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(toks))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if not omit_tokenizer and tokenizer == "spm":
        toks, scores, token_types = spm_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(toks)
        writer.add_token_scores(scores)
        writer.add_token_types(token_types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(True)
    elif not omit_tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(toks)
        writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in toks])
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(len(toks) - 2)
        writer.add_eos_token_id(len(toks) - 1)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    block = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    held_state = {}
    for name, w in state.items():
        if tie and name == "lm_head.weight":
            continue
        if name in names:
            gname = names[name]
        else:
            parts = name.split(".")  # model.layers.<i>.<module...>.<weight|bias>
            gname = f"blk.{parts[2]}.{block['.'.join(parts[3:-1])]}.{parts[-1]}"
        kind = gname.split(".")[2] if gname.startswith("blk.") else gname.split(".")[0]
        permute_heads = None
        if arch == "llama" and kind in ("attn_q", "attn_k") and gname.endswith(".weight"):
            permute_heads = heads if kind == "attn_q" else kv_heads
        data, t, held = _encode(gname, w, types.get(kind, qtype), rng, permute_heads)
        writer.add_tensor(gname, data, raw_dtype=t)
        held_state[name] = torch.from_numpy(np.ascontiguousarray(held))
    if tie:
        held_state["lm_head.weight"] = held_state["model.embed_tokens.weight"]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    model.load_state_dict(held_state)
    hf = dir_path / "hf"
    model.save_pretrained(str(hf), safe_serialization=True)
    return dir_path / "model.gguf", hf
