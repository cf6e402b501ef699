"""Do llama.cpp's greedy tokens (bench peers' runner, batched) match HF's on the same checkpoint and prompts?

Converts a checkpoint (default: a tiny random fp32 Llama written here through tests/helpers.py) to GGUF with
the same steps ``bench peers`` uses, runs one ``llamacpp_peer.py run`` child at batch B (so the batched
``llama_decode`` path is what is checked, every sequence against its own HF row), and HF ``generate`` greedy on
the same prompt token ids; prints, per sequence, how many leading tokens agree.

    python scripts/llamacpp_greedy_check.py --llamacpp-python /work/llama-venv/bin/python \\
        --llamacpp-converter /work/llama-convert/convert_hf_to_gguf.py [--model M] [--dtype float32]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp-python", required=True)
    ap.add_argument("--llamacpp-converter", required=True)
    ap.add_argument("--model", default=None, help="HF checkpoint (default: a tiny random Llama made here)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quant", default=None, choices=("q8_0", "q4_0"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--cache-dir", default=None, help="GGUF cache (default: a temporary folder)")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from openinfer.bench import llamacpp_peer as lp
    from openinfer.bench.throughput import make_prompts

    with tempfile.TemporaryDirectory(prefix="llamacpp-greedy-") as tmp:
        model = a.model
        if model is None:
            from tests.helpers import make_dense_checkpoint

            model = str(make_dense_checkpoint(Path(tmp) / "tiny", "llama"))
        cache = a.cache_dir or str(Path(tmp) / "gguf")
        Path(cache).mkdir(parents=True, exist_ok=True)
        h = lp.checkpoint_hash(model)
        for _, cmd in lp.convert_commands(a.llamacpp_python, a.llamacpp_converter, model, cache, h, a.dtype,
                                          a.quant):
            subprocess.run(cmd, check=True)
        gtype = lp.gguf_type(a.dtype, a.quant)
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        prompts = make_prompts(0, a.batch, 0, a.input_len, vocab, 16)
        spec = {"schema": lp.SPEC_SCHEMA, "gguf": str(lp.gguf_path(cache, h, gtype)), "gguf_type": gtype,
                "batch_size": a.batch, "n_threads": 2, "mode": "e2e", "input_len": a.input_len,
                "output_len": a.output_len, "decode_steps": None, "warmup_prompt_sets": [], "timed_prompts": prompts,
                "record_all_tokens": True}  # every sequence's tokens, not only the first one's
        out, spec_path = Path(tmp) / "out.json", str(Path(tmp) / "spec.json")
        Path(spec_path).write_text(json.dumps(spec))
        subprocess.run(lp.child_command(a.llamacpp_python, spec_path, str(out)), check=True)
        got = lp.read_child(out)["all_output_token_ids"]

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, a.dtype)).eval()
        with torch.no_grad():
            ref = hf.generate(torch.tensor(prompts), do_sample=False, max_new_tokens=a.output_len,
                              min_new_tokens=a.output_len, pad_token_id=0)[:, a.input_len:].tolist()
    print(f"checkpoint {model}, GGUF {gtype}, batch {a.batch}, input {a.input_len}, output {a.output_len}")
    for s, (x, y) in enumerate(zip(got, ref)):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(y))
        print(f"seq {s}: {n}/{len(y)} leading tokens equal  llama.cpp {x[:8]}...  HF {y[:8]}...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
