"""A GGUF file's tensors under the HF names the models load (``gguf_file.py`` has already checked names, types and
shapes): plain F32 / F16 / BF16 tensors as torch tensors, block-quantized ones as ``GGUFWeight``\\ s that stay in
their file layout (``layers/gguf_quant.py``), never dequantised at load.

One transformation: llama.cpp's converter stores a ``llama``-architecture model's q / k projections with each
head's rows interleaved (``convert_hf_to_gguf.py`` ``LlamaModel.permute``: HF row (h, half, j) -> GGUF row
(h, j, half), for its interleaved RoPE); openinfer's Llama applies rotate-half RoPE as HF does, so those rows are
put back in HF order. A row is a run of whole blocks in every GGUF type, so moving rows moves bytes and changes no
value. Qwen2 / Qwen3 are stored unpermuted.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from openinfer.gguf_file import PLAIN_TYPES, GGUFError, open_gguf
from openinfer.layers.gguf_quant import GGUFWeight

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PLAIN_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")  # blk.<i>.<tensor>.<weight|bias>
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK:
        return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}.{parts[3]}"
    raise GGUFError(f"GGUF tensor {name!r} has no counterpart in the model")


def unpermute_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's q / k permutation on a [heads * head_dim, ...] row-major tensor (any dtype: rows of
    packed bytes too)."""
    n = rows.shape[0]
    d = n // heads
    return rows.reshape(heads, d // 2, 2, -1).transpose(1, 2).reshape(rows.shape).contiguous()


def iterate_gguf_weights(cfg: dict[str, Any], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """(HF name, tensor or ``GGUFWeight``) for every tensor of the config's GGUF file (``cfg["_gguf_file"]``)."""
    reader = open_gguf(cfg["_gguf_file"])
    permute = cfg["_gguf_architecture"] == "llama"
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            data = torch.from_numpy(np.array(t.data))  # one copy out of the memory map, still in the file's layout
        except Exception as e:  # a data region cut short surfaces here on some numpy versions
            raise GGUFError(f"cannot read tensor {t.name!r} from {cfg['_gguf_file']!r}: {e} (truncated?)") from None
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if qtype in PLAIN_TYPES:
            tensor = data.view(_PLAIN_DTYPES[qtype]).reshape(shape)
            if permute and kind in heads and t.name.endswith(".weight"):
                tensor = unpermute_rows(tensor, heads[kind])
            yield hf_name(t.name), tensor
            continue
        rows = data.reshape(shape[0], -1)
        if permute and kind in heads:
            rows = unpermute_rows(rows, heads[kind])
        try:
            weight = GGUFWeight(qtype, rows, shape, dtype)
        except ValueError as e:
            raise GGUFError(f"GGUF tensor {t.name!r}: {e}") from None
        yield hf_name(t.name), weight
