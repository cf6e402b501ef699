"""llama.cpp as a ``bench peers`` peer: llama-cpp-python on the same checkpoint converted to GGUF, one fresh
process per (batch, iteration), in the Python of the venv llama-cpp-python is built in.

llama-cpp-python compiles llama.cpp for the host (GGML_NATIVE) and lives in its own venv (cpu_peers.md section
4), so, like ``vllm_peer.py``, this file is both sides of a process boundary and imports only the standard
library at the top; the child side runs as a plain script there without openinfer installed:

* parent side (openinfer's interpreter, ``bench peers``): ``detect`` finds a Python that imports llama_cpp;
  ``gguf_path`` keys the converted file by a hash of the checkpoint's files and the GGUF type;
  ``convert_commands`` builds the conversion (``convert_hf_to_gguf.py`` from llama.cpp's source, which ships
  in llama-cpp-python's sdist with the ``gguf-py`` and ``conversion`` folders beside it) and, for ``q8_0`` / ``q4_k_m`` /
  ``q4_0``, the quantization (``llama_model_quantize`` through llama-cpp-python's bindings, llama.cpp's own
  quantizer, from the ``--dtype`` GGUF); ``child_spec`` writes the workload -- the prompt token ids come from
  openinfer's ``make_prompts`` -- and ``read_child`` reads the child's JSON back.
* child side, ``python llamacpp_peer.py run --spec S --output-json O``: loads the GGUF with llama.cpp's C API
  (``llama_model_load_from_file`` / ``llama_init_from_model`` with ``n_threads = n_threads_batch =
  --num-threads``, ``n_seq_max = batch``, ``n_ctx = batch x (input + output)``), runs the warm-up prompt sets
  untimed, then times one generation of the timed set. llama-cpp-python's high-level ``Llama`` is one
  sequence at a time, so generation uses the low-level batch API the way llama.cpp's ``batched`` example
  does: one ``llama_batch`` holding every prompt's tokens, each with its own ``seq_id`` (the prefill), then one
  ``llama_decode`` per step with one token per sequence -- batch 8 / 32 / 64 are real batched decodes over a
  shared KV cache. Sampling is greedy (argmax over each sequence's logits row, in numpy); EOS is never checked,
  so every sequence generates exactly ``output_len`` tokens. The KV cache is cleared before every generation.
* ``python llamacpp_peer.py convert ...`` / ``quantize ...``: the two preparation steps, in the same Python.

The converter refuses tokenizers it cannot map to a llama.cpp vocab (the Llama bench checkpoint's char-level
WordLevel tokenizer hits "BPE pre-tokenizer was not recognized"). Benchmarks feed token ids, never text, so in
that case ``convert`` writes the tokenizer's own id -> string table as an SPM-type vocab (ids unchanged, BOS /
EOS from the checkpoint) and records that it did so; the weights are converted by the converter untouched.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SPEC_SCHEMA = "openinfer.bench.llamacpp_peer.spec/v1"
RESULT_SCHEMA = "openinfer.bench.llamacpp_peer.result/v1"
QUANTS = ("q8_0", "q4_0", "q4_k_m")
# --dtype -> the converter's --outtype for the unquantized GGUF
_OUTTYPES = {"float32": "f32", "float": "f32", "bfloat16": "bf16", "float16": "f16", "half": "f16"}
_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
           "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
_ENV_PREFIXES = ("OMP_", "GOMP_", "GGML_", "LLAMA_", "MALLOC_")
_CHECKPOINT_FILES = (".safetensors", ".json", ".model")  # what a conversion reads


# ---------------------------------------------------------------- parent side (openinfer's interpreter)

def detect(llamacpp_python: str | None) -> dict[str, Any]:
    """The Python to run llama.cpp with: ``--llamacpp-python`` when given (an error if it cannot import
    llama_cpp), else this interpreter if it imports llama_cpp, else ``not installed``."""
    import importlib.util

    if llamacpp_python is None:
        if importlib.util.find_spec("llama_cpp") is None:
            return {"peer": "llamacpp", "status": "not installed"}
        llamacpp_python = sys.executable
    path = Path(llamacpp_python)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ValueError(f"--llamacpp-python {llamacpp_python}: no executable file there (give the Python of "
                         f"the venv llama-cpp-python is installed in, e.g. /path/to/llama-venv/bin/python)")
    probe = "import llama_cpp\nprint(llama_cpp.__version__)\n"
    try:
        proc = subprocess.run([str(path), "-c", probe], capture_output=True, text=True, timeout=300)
    except OSError as e:
        raise ValueError(f"--llamacpp-python {llamacpp_python}: cannot run it: {e}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ValueError(f"--llamacpp-python {llamacpp_python}: `import llama_cpp` failed there: {last}")
    return {"peer": "llamacpp", "status": "installed", "python": str(path),
            "version": proc.stdout.strip().splitlines()[-1]}


def check_converter(path: str | None) -> str:
    """``--llamacpp-converter``: llama.cpp's ``convert_hf_to_gguf.py`` with its ``gguf-py`` and ``conversion``
    folders beside it (as in llama-cpp-python's sdist, ``vendor/llama.cpp``)."""
    if not path:
        raise ValueError("--llamacpp-converter is required to run llama.cpp: the path of convert_hf_to_gguf.py "
                         "from llama.cpp's source (llama-cpp-python's sdist has it under vendor/llama.cpp)")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--llamacpp-converter {path}: no such file")
    missing = [d for d in ("gguf-py", "conversion") if not (p.parent / d).is_dir()]
    if missing:
        raise ValueError(f"--llamacpp-converter {path}: {' and '.join(missing)} missing beside it (the converter "
                         f"imports them from its own folder; copy vendor/llama.cpp whole)")
    return str(p.resolve())


def gguf_type(dtype: str, quant: str | None) -> str:
    """The GGUF tensor type this run uses: the ``--dtype`` one, or ``--llamacpp-quant``."""
    if quant is not None:
        if quant not in QUANTS:
            raise ValueError(f"--llamacpp-quant takes one of {', '.join(QUANTS)}, got {quant!r}")
        return quant
    try:
        return _OUTTYPES[dtype]
    except KeyError:
        raise ValueError(f"--dtype {dtype!r} has no GGUF type (llama.cpp runs {', '.join(_OUTTYPES)})") from None


def checkpoint_hash(model_path: str | Path) -> str:
    """sha256 over the names and contents of the checkpoint files a conversion reads (weights, config,
    tokenizer), so a rewritten checkpoint at the same path never reuses a stale GGUF."""
    h = hashlib.sha256()
    files = sorted(f for f in Path(model_path).iterdir() if f.is_file() and f.name.endswith(_CHECKPOINT_FILES))
    if not any(f.name.endswith(".safetensors") for f in files):
        raise ValueError(f"{model_path}: no .safetensors files to convert to GGUF")
    for f in files:
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def gguf_path(cache_dir: str | Path, ckpt_hash: str, gtype: str) -> Path:
    return Path(cache_dir) / f"{ckpt_hash[:20]}-{gtype}.gguf"


def convert_commands(python: str, converter: str | None, model_path: str, cache_dir: str | Path, ckpt_hash: str,
                     dtype: str, quant: str | None) -> list[tuple[Path, list[str]]]:
    """``(output, command)`` for each GGUF this run needs that the cache lacks, in order: the ``--dtype`` one
    (the converter), then the quantized one made from it (llama.cpp's quantizer). ``converter`` is checked
    only when a conversion is needed, so a cached GGUF runs without llama.cpp's source at hand."""
    base = gguf_type(dtype, None)
    steps = []
    base_path = gguf_path(cache_dir, ckpt_hash, base)
    script = str(Path(__file__).resolve())
    if not base_path.exists() and not (quant and gguf_path(cache_dir, ckpt_hash, quant).exists()):
        steps.append((base_path, [python, script, "convert", "--converter", check_converter(converter), "--model", model_path,
                                  "--outtype", base, "--outfile", str(base_path)]))
    if quant:
        q_path = gguf_path(cache_dir, ckpt_hash, gtype := gguf_type(dtype, quant))
        if not q_path.exists():
            steps.append((q_path, [python, script, "quantize", "--input", str(base_path), "--type", gtype,
                                   "--outfile", str(q_path)]))
    return steps


def child_spec(args: argparse.Namespace, gguf: str, gtype: str, batch: int, vocab_size: int) -> dict[str, Any]:
    """The workload of one child, with the prompt sets a one-point ``bench throughput`` child uses: the sweep
    warm-up (iteration -1), ``warmup_iters - 1`` more (-2, ...), then the timed set (iteration 0)."""
    from openinfer.bench.throughput import make_prompts

    if args.temperature:
        raise ValueError(f"the llama.cpp runner decodes greedily only; got --temperature {args.temperature}")

    def prompts(it: int) -> list[list[int]]:
        return make_prompts(args.seed, batch, it, args.input_len, vocab_size, args.block_size)

    decode = args.mode == "decode"
    return {
        "schema": SPEC_SCHEMA, "gguf": gguf, "gguf_type": gtype, "batch_size": batch,
        "n_threads": args.num_threads or len(os.sched_getaffinity(0)),
        "mode": args.mode, "input_len": args.input_len,
        "output_len": None if decode else args.output_len, "decode_steps": args.decode_steps if decode else None,
        "warmup_prompt_sets": [prompts(-1 - w) for w in range(max(args.warmup_iters, 1))],
        "timed_prompts": prompts(0),
    }


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ``base`` (default ``os.environ``) plus the allocator settings openinfer runs
    with (``platform.MALLOC_ENV``), as the HF runner and the vLLM child get them, unless the caller set its own
    or turned them off (``OPENINFER_MALLOC_TUNING=0``)."""
    from openinfer import platform as oi_platform

    env = dict(os.environ if base is None else base)
    if oi_platform.malloc_tuning_enabled():
        for k, v in oi_platform.MALLOC_ENV.items():
            env.setdefault(k, v)
    return env


def child_command(python: str, spec_path: str, json_path: str) -> list[str]:
    return [python, str(Path(__file__).resolve()), "run", "--spec", spec_path, "--output-json", json_path]


def read_child(path: str | Path) -> dict[str, Any]:
    """The child's JSON, checked (peer_child.py: the same shape for every peer)."""
    from openinfer.bench.peer_child import read_child_json  # parent side only: this file's top is stdlib

    return read_child_json(path, RESULT_SCHEMA, "llamacpp_peer")


# ---------------------------------------------------------------- child side (llama-cpp-python's interpreter)

def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _fallback_vocab(model, dir_model: Path) -> None:
    """Write the HF tokenizer's id -> token table as an SPM-type ("llama") GGUF vocab: same ids, specials as
    control tokens, BOS / EOS from the checkpoint. Only for tokenizers the converter refuses (see the top)."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dir_model)
    n = model.hparams["vocab_size"]
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    for text, i in tok.get_vocab().items():
        if i < n:
            tokens[i] = text.encode("utf-8")
    types = [gguf.TokenType.NORMAL] * n
    for i in tok.all_special_ids:
        if i < n:
            types[i] = gguf.TokenType.CONTROL
    w = model.gguf_writer
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types(types)
    gguf.SpecialVocab(dir_model, load_merges=False, n_vocab=n).add_to_gguf(w)


def _convert(a: argparse.Namespace) -> dict[str, Any]:
    conv_dir = str(Path(a.converter).resolve().parent)
    sys.path[:0] = [conv_dir]
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", a.converter)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # puts its gguf-py on sys.path and imports ``conversion``
    arch = json.loads((Path(a.model) / "config.json").read_text())["architectures"][0]
    from conversion import get_model_class  # the converter's own registry (imports the model's module)

    cls = get_model_class(arch)
    used = {"vocab": "converter"}
    original = cls.set_vocab

    def set_vocab(self):
        try:
            original(self)
        except (NotImplementedError, FileNotFoundError, TypeError, ValueError, OSError) as e:
            print(f"llamacpp_peer: the converter cannot convert this tokenizer ({type(e).__name__}: {e}); "
                  f"writing its id -> token table instead (token ids unchanged)", file=sys.stderr)
            used["vocab"] = f"id table of the HF tokenizer (converter: {type(e).__name__}: {e})"
            _fallback_vocab(self, Path(a.model))

    cls.set_vocab = set_vocab
    tmp = Path(a.outfile + ".part")
    sys.argv = ["convert_hf_to_gguf.py", a.model, "--outtype", a.outtype, "--outfile", str(tmp)]
    mod.main()
    os.replace(tmp, a.outfile)
    return {"architecture": arch, "outtype": a.outtype, **used}


def _quantize(a: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, _FTYPES[a.type])
    params.nthread = len(os.sched_getaffinity(0))
    tmp = a.outfile + ".part"
    rc = llama_cpp.llama_model_quantize(a.input.encode(), tmp.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({a.input} -> {a.type}) returned {rc}")
    os.replace(tmp, a.outfile)
    return {"input": a.input, "type": a.type}


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp as L
    import numpy as np

    B, in_len = spec["batch_size"], spec["input_len"]
    decode = spec["mode"] == "decode"
    n_out = spec["decode_steps"] + 1 if decode else spec["output_len"]
    load_average = _load_average()
    t0 = time.perf_counter()
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(spec["gguf"].encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {spec['gguf']}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cparams = L.llama_context_default_params()
    cparams.n_ctx = B * (in_len + n_out)
    cparams.n_batch = B * in_len  # the whole prefill is one llama_batch; llama.cpp splits it into n_ubatch
    cparams.n_seq_max = B
    cparams.n_threads = cparams.n_threads_batch = spec["n_threads"]
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    init_time_s = time.perf_counter() - t0
    batch = L.llama_batch_init(B * in_len, 0, 1)

    def fill(entries: list[tuple[int, int, int, bool]]) -> None:
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(entries)

    def step() -> list[int]:
        """One llama_decode of the filled batch; the greedy token of each sequence (one output row each)."""
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(B * n_vocab,)).reshape(B, n_vocab)
        return rows.argmax(axis=1).tolist()

    def generate(prompts: list[list[int]]) -> tuple[list[list[int]], float, float]:
        """(tokens per sequence, seconds to the first token, seconds to the last)."""
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        t = time.perf_counter()
        fill([(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)])
        nxt = step()
        first = time.perf_counter() - t
        out = [[x] for x in nxt]
        for k in range(1, n_out):
            fill([(nxt[s], in_len + k - 1, s, True) for s in range(B)])
            nxt = step()
            for s in range(B):
                out[s].append(nxt[s])
        return out, first, time.perf_counter() - t

    for prompts in spec["warmup_prompt_sets"]:
        generate(prompts)
    prompts = spec["timed_prompts"]
    if len(prompts) != B or any(len(p) != in_len for p in prompts):
        raise ValueError(f"timed prompts are not {B} x {in_len} tokens")
    out, first, total = generate(prompts)
    if decode:
        k = spec["decode_steps"]
        sample = {"elapsed_s": total - first, "num_output_tokens": B * k, "num_input_tokens": 0,
                  "mean_ttft_s": None, "kv_context": [in_len, in_len]}
    else:
        sample = {"elapsed_s": total, "num_output_tokens": B * n_out, "num_input_tokens": B * in_len,
                  "mean_ttft_s": first, "kv_context": None}
    sample.update(cached_prompt_tokens=0, num_preemptions=0)
    notes = ["llama.cpp: batched through the C API (one llama_batch of all prompts, one seq_id each, then one "
             "llama_decode per step for all sequences), greedy argmax, EOS never checked"]
    if decode:
        notes.append("llama.cpp decode mode: the window is the decode_steps llama_decode calls after the "
                     "prefill and first token, timed directly")
    describe = {
        "runner": "llama-cpp-python low-level batch API (openinfer/bench/llamacpp_peer.py, a fresh process in "
                  "llama-cpp-python's venv)",
        "llama_cpp_python": L.__version__, "python": sys.executable, "gguf": spec["gguf"],
        "gguf_type": spec["gguf_type"], "dtype": spec["gguf_type"],
        "n_threads": L.llama_n_threads(ctx), "n_ctx": L.llama_n_ctx(ctx), "n_batch": L.llama_n_batch(ctx),
        "n_seq_max": B, "system_info": L.llama_print_system_info().decode(errors="replace").strip(),
        "sampling": "greedy (argmax)",
        "env_vars": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
        "init_time_s": init_time_s, "load_time_s": None,
    }
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    result = {
        "schema": RESULT_SCHEMA, "engine": describe,
        "environment": {"python": sys.version.split()[0], "platform": platform.platform(),
                        "load_average": load_average, "load_average_end": _load_average()},
        "sample": sample, "first_output_token_ids": out[0], "notes": notes,
    }
    if spec.get("record_all_tokens"):  # scripts/llamacpp_greedy_check.py compares every sequence with HF
        result["all_output_token_ids"] = out
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="bench peers' llama.cpp side (run by openinfer bench peers)")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one bench peers point")
    r.add_argument("--spec", required=True, help="the workload JSON the parent wrote")
    r.add_argument("--output-json", required=True)
    c = sub.add_parser("convert", help="HF checkpoint -> GGUF with llama.cpp's convert_hf_to_gguf.py")
    c.add_argument("--converter", required=True)
    c.add_argument("--model", required=True)
    c.add_argument("--outtype", required=True, choices=sorted(set(_OUTTYPES.values())))
    c.add_argument("--outfile", required=True)
    q = sub.add_parser("quantize", help="GGUF -> Q8_0 / Q4_0 GGUF with llama.cpp's quantizer")
    q.add_argument("--input", required=True)
    q.add_argument("--type", required=True, choices=QUANTS)
    q.add_argument("--outfile", required=True)
    a = p.parse_args(argv)
    if a.cmd == "convert":
        info = _convert(a)
    elif a.cmd == "quantize":
        info = _quantize(a)
    else:
        spec = json.loads(Path(a.spec).read_text())
        if spec.get("schema") != SPEC_SCHEMA:
            raise SystemExit(f"{a.spec}: schema {spec.get('schema')!r}, want {SPEC_SCHEMA}")
        Path(a.output_json).write_text(json.dumps(_run(spec), indent=2) + "\n")
        return 0
    Path(a.outfile + ".json").write_text(json.dumps(info, indent=2) + "\n")  # how the GGUF was made
    return 0


if __name__ == "__main__":
    # Run as a script, this file's folder heads sys.path, and its siblings (cli.py, metrics.py, ...) would
    # shadow top-level modules of those names.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [q for q in sys.path if os.path.abspath(q or ".") != _here]
    sys.exit(main())
