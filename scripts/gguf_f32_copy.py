"""Write an F32 copy of a GGUF file: every tensor dequantised by gguf's own numpy, the metadata unchanged. llama.cpp
then multiplies fp32 activations (no q8 rounding): its perplexity on the copy is llama.cpp's fp32 baseline for the
int8-activation comparison in docs/gguf_kernels.md. Run with the llama-cpp-python venv (it has ``gguf``):

    python scripts/gguf_f32_copy.py SRC.gguf DST.gguf
"""
import sys

import gguf
import numpy as np


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32),
                     raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", dst)


if __name__ == "__main__":
    main()
