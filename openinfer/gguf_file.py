"""GGUF files (llama.cpp's format) as model checkpoints: find the file, read its metadata with llama.cpp's own
``gguf`` package, and turn it into the HF-style config the models are built from, checking everything before a
single weight is read.

What is checked up front, each failure one ``GGUFError`` (a ``ValueError``) that names the file and the field:
the file opens (magic, header, tensor table inside the file: a truncated or corrupt file fails here), the
architecture is one openinfer maps (``ARCHITECTURES``), every tensor's type is one it executes (``TENSOR_TYPES``),
every tensor the architecture needs is present with the shape its metadata implies, and the tokenizer metadata
(``tokenizer.ggml.model`` / ``tokens``) is there. The weights themselves are read later, by
``models/gguf_weights.py``; the tokenizer is built by transformers' GGUF converter (``tokenizer.py``).

The reader is cached per (path, size, mtime): opening parses every metadata array (the 49k-entry vocabulary of a
small model takes ~3 s), and the config, the tokenizer and the weights all need it.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# llama.cpp architecture names openinfer runs; the config names "gguf:<name>", which the model registry maps to the
# family's class. deepseek2 (llama.cpp's name for the DeepSeek-V2/V3 layout) is not among them: its converters
# split kv_b into attn_k_b / attn_v_b and differ by version.
ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Tensor types openinfer runs: plain ones become ordinary parameters, the block-quantized ones stay packed
# (layers/gguf_quant.py).
PLAIN_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
TENSOR_TYPES = PLAIN_TYPES + QUANT_TYPES


class GGUFError(ValueError):
    """A GGUF file openinfer cannot run: one line naming the file and what is wrong."""


def is_gguf(path: str | os.PathLike) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def find_gguf(path: str | os.PathLike) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one ``*.gguf`` in a folder that has no config.json.
    None for anything else (an HF-format folder). A folder with several GGUF files must be told which one."""
    p = Path(path)
    if p.is_file() and is_gguf(p):
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        files = sorted(f for f in p.glob("*.gguf") if f.is_file())
        if len(files) > 1:
            raise GGUFError(f"{str(p)!r} holds {len(files)} GGUF files ({', '.join(f.name for f in files[:4])}); "
                            "pass the one to load as --model")
        return files[0] if files else None
    return None


def open_gguf(path: str | os.PathLike):
    """llama.cpp's ``GGUFReader`` on the file (memory-mapped; cached)."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as e:
        raise GGUFError(f"cannot read GGUF file {str(path)!r}: {e.strerror}") from None
    return _open(str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open(path: str, size: int, mtime: int):
    import gguf

    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError / numpy errors on bad magic, short header, short data
        raise GGUFError(f"cannot read GGUF file {path!r}: {e} (not a GGUF file, or truncated / corrupt)") from None


def field(reader, key: str, default: Any = None, required: bool = False) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise GGUFError(f"GGUF file {reader.data.filename!r} has no {key!r} metadata")
        return default
    try:
        return f.contents()
    except Exception as e:
        raise GGUFError(f"GGUF file {reader.data.filename!r}: metadata {key!r} cannot be read: {e}") from None


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    qtype: str  # GGMLQuantizationType name
    shape: tuple[int, ...]  # PyTorch order: [out, in] for a matrix (GGUF lists dimensions innermost first)


def tensor_infos(reader) -> dict[str, GGUFTensorInfo]:
    return {t.name: GGUFTensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())))
            for t in reader.tensors}


def gguf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The HF-style config.json dict of a GGUF file, after checking the file can be run (module docstring).
    Private keys: ``_gguf_file`` (the file), ``_gguf_architecture`` (llama.cpp's name)."""
    reader = open_gguf(path)
    name = str(path)
    arch = field(reader, "general.architecture", required=True)
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF file {name!r}: architecture {arch!r} is not supported; openinfer runs "
                        f"{', '.join(ARCHITECTURES)}")
    infos = tensor_infos(reader)
    bad = [(i.name, i.qtype) for i in infos.values() if i.qtype not in TENSOR_TYPES]
    if bad:
        raise GGUFError(f"GGUF file {name!r}: tensor {bad[0][0]!r} has type {bad[0][1]}, which openinfer does not "
                        f"run ({len(bad)} such tensors); supported: {', '.join(TENSOR_TYPES)}")
    if field(reader, "tokenizer.ggml.model") is None or "tokenizer.ggml.tokens" not in reader.fields:
        raise GGUFError(f"GGUF file {name!r} has no tokenizer metadata (tokenizer.ggml.model / tokens); "
                        "pass --tokenizer with an HF tokenizer folder")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        return field(reader, f"{arch}.{key}", default, required)

    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    vocab = int(get("vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data)))
    cfg: dict[str, Any] = {
        "architectures": [f"gguf:{arch}"],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in infos,
        # GGUF activations run in fp32, as llama.cpp's do (the packed kernels take fp32 inputs either way)
        "torch_dtype": "float32",
        "_gguf_file": str(Path(path).resolve()),
        "_gguf_architecture": arch,
    }
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        v = field(reader, f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[hf] = int(v)
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear" and scaling != "yarn":
            raise GGUFError(f"GGUF file {name!r}: {arch}.rope.scaling.type={scaling!r} is not supported")
        factor = float(get("rope.scaling.factor", 1.0))
        cfg["rope_scaling"] = {"rope_type": scaling, "type": scaling, "factor": factor}
        if scaling == "yarn":
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length", cfg["max_position_embeddings"]))
    check_tensor_shapes(name, cfg, infos)
    return cfg


def expected_shapes(cfg: dict[str, Any], names: set[str]) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> the [out, in] shape the config implies (biases and q/k norms only where the file has
    them: Qwen2 carries q/k/v biases, Qwen3 q/k norms)."""
    h, heads, kv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["output.weight"] = (vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        shapes.update({
            b + "attn_norm.weight": (h,), b + "ffn_norm.weight": (h,),
            b + "attn_q.weight": (heads * d, h), b + "attn_k.weight": (kv * d, h), b + "attn_v.weight": (kv * d, h),
            b + "attn_output.weight": (h, heads * d),
            b + "ffn_gate.weight": (inter, h), b + "ffn_up.weight": (inter, h), b + "ffn_down.weight": (h, inter),
        })
        optional = {b + "attn_q.bias": (heads * d,), b + "attn_k.bias": (kv * d,), b + "attn_v.bias": (kv * d,),
                    b + "attn_q_norm.weight": (d,), b + "attn_k_norm.weight": (d,)}
        shapes.update({k: v for k, v in optional.items() if k in names})
    return shapes


def check_tensor_shapes(name: str, cfg: dict[str, Any], infos: dict[str, GGUFTensorInfo]) -> None:
    want = expected_shapes(cfg, set(infos))
    missing = sorted(set(want) - set(infos))
    if missing:
        raise GGUFError(f"GGUF file {name!r} is missing {len(missing)} tensors its metadata implies, e.g. "
                        f"{missing[:3]}")
    for t, shape in want.items():
        if infos[t].shape != shape:
            raise GGUFError(f"GGUF file {name!r}: tensor {t!r} has shape {list(infos[t].shape)}, its metadata "
                            f"implies {list(shape)}")
    if "rope_freqs.weight" in infos:  # Llama-3.1-style scaled RoPE, stored only as per-frequency factors
        raise GGUFError(f"GGUF file {name!r} has rope_freqs.weight (Llama 3.1 RoPE scaling), which openinfer does "
                        "not apply yet")
    unknown = sorted(set(infos) - set(want))
    if unknown:
        raise GGUFError(f"GGUF file {name!r}: tensor {unknown[0]!r} does not belong to a "
                        f"{cfg['_gguf_architecture']} model ({len(unknown)} such tensors)")
