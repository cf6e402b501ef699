"""The human-readable side of ``bench peers``: the throughput-vs-batch PNG and the markdown summary."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

_TITLES = {
    "e2e": "output tok/s, prefill included",
    "decode": "decode tok/s, prefill excluded",
}


def _engines(result: dict[str, Any]) -> list[str]:
    return ["openinfer"] + [e for e in result["engines"] if e != "openinfer"]


def _metric(result: dict[str, Any]) -> str:
    # With several devices the per-device rate is the one comparable across deployments (issue 5).
    return "output_throughput_per_device" if result["environment"]["num_devices"] > 1 else "output_throughput"


def _command(result: dict[str, Any]) -> str:
    argv = list(result["command"])
    if argv and argv[0].endswith("__main__.py"):  # sys.argv of ``python -m openinfer``
        return "python -m openinfer " + shlex.join(argv[1:])
    return shlex.join(argv)


def workload_line(result: dict[str, Any]) -> str:
    w = result["workload"]
    if w["mode"] == "decode":
        what = f"decode at context {w['context_len']}, {w['decode_steps']} timed steps"
    else:
        what = f"input {w['input_len']} / output {w['output_len']} tokens"
    env = result["environment"]
    dtype = result["engines"]["openinfer"]["dtype"]
    return (f"{what}; {dtype}; greedy, EOS ignored; torch threads: {env['torch_num_threads']}; median of "
            f"{w['num_iters']} fresh processes per point")


def write_plot(result: dict[str, Any], path: Path) -> Path:
    from openinfer.bench.curves import Curve
    from openinfer.bench.plots import plot_throughput_vs_batch, provenance_caption

    env, metric = result["environment"], _metric(result)
    curves = []
    for engine in _engines(result):
        pts = [p for p in result["points"] if p.get(engine)]
        if not pts:
            continue
        meta = {"hardware": env.get("cpu_model"), "num_devices": env["num_devices"], "date": result["date"],
                "measured_by": "openinfer bench peers", "dtype": result["engines"][engine].get("dtype"),
                "model": (env.get("model") or {}).get("path"),
                "context_len": result["workload"]["context_len"]}
        curves.append(Curve(label=engine, xs=[p["batch_size"] for p in pts],
                            ys=[p[engine][metric] for p in pts], x_metric="batch_size", y_metric=metric,
                            meta=meta, read_off_chart=False))
    y_label = _TITLES[result["workload"]["mode"]] + (" per device" if metric.endswith("_per_device") else "")
    caption = f"{workload_line(result)}\n{provenance_caption(curves)}\ncmd: {_command(result)}"
    return plot_throughput_vs_batch(curves, path, y_label=y_label, caption=caption)


def _cell(s: dict[str, Any] | None, metric: str) -> str:
    if not s:
        return "–"
    lo, hi = s["output_throughput_min"], s["output_throughput_max"]
    scale = s[metric] / s["output_throughput"]  # per-device bounds scale like the median
    return f"{s[metric]:.1f} ({lo * scale:.1f}–{hi * scale:.1f})"


def results_table(result: dict[str, Any]) -> str:
    engines, metric = _engines(result), _metric(result)
    peers = engines[1:]
    head = ["batch"] + [f"{e} tok/s" for e in engines] + [f"openinfer / {p}" for p in peers]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in result["points"]:
        ratios = p.get("ratios_openinfer_over") or {}
        cells = [str(p["batch_size"])] + [_cell(p.get(e), metric) for e in engines]
        cells += [f"{ratios[q]['output_throughput']:.2f}x" if q in ratios else "–" for q in peers]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _peer_line(s: dict[str, Any]) -> str:
    extra = f", {s['version']}" if s.get("version") else ""
    reason = f": {s['reason']}" if s.get("reason") else ""
    return f"| {s['peer']} | {s['status']}{extra}{reason} |"


def _environment(result: dict[str, Any]) -> list[str]:
    env, w = result["environment"], result["workload"]
    model = env.get("model") or {}
    oi = result["engines"]["openinfer"]
    lines = [
        f"- CPU: {env.get('cpu_model')} ({env.get('cpu_count')} logical CPUs; flags: "
        f"{', '.join(env.get('cpu_flags') or []) or 'none of the listed'}), device `{env['device']}`, "
        f"{env['num_devices']} device(s)",
        f"- threads: torch {env['torch_num_threads']}; env {env.get('env_vars') or {}}",
        f"- versions: openinfer {env.get('openinfer')}, torch {env['torch']}, transformers "
        f"{env['transformers']}, Python {env['python']}",
        f"- dtype: {oi['dtype']} (both engines); model: {model.get('architecture')} "
        f"{(model.get('num_params') or 0) / 1e6:.1f}M params at `{model.get('path')}`",
        *_weights_lines(result),
        f"- workload: mode {w['mode']}, "
        + (f"context {w['context_len']}, decode steps {w['decode_steps']}, " if w["mode"] == "decode" else
           f"input {w['input_len']}, output {w['output_len']}, ")
        + f"batches {w['batch_sizes']}, "
        f"{w['num_iters']} iterations (+{w['warmup_iters']} warm-up) per point, temperature "
        f"{w['temperature']}, speculative decoding {w['speculative_config']}",
        f"- openinfer engine: max_num_seqs {oi.get('max_num_seqs')}, max_num_batched_tokens "
        f"{oi.get('max_num_batched_tokens')}, max_model_len {oi.get('max_model_len')}, KV blocks "
        f"{oi.get('num_kv_blocks')} of {oi.get('block_size')}, attention {oi.get('attention_backend')}",
        *_vllm_lines(result),
        *_llamacpp_lines(result),
        f"- load average: start {env.get('load_average')}, end {env.get('load_average_end')}",
        f"- date: {result['date']}",
        f"- command: `{_command(result)}`",
    ]
    return lines


def _weights_lines(result: dict[str, Any]) -> list[str]:
    w = result.get("weights")
    if not w or not any(w.values()):
        return []
    return [f"- weights: checkpoint quantization {w.get('checkpoint_quantization') or 'none'}; openinfer "
            f"--quantization {w.get('openinfer_quantization') or 'none'}"
            + (f"; llama.cpp GGUF quantized to {w['llamacpp_quant']}" if w.get("llamacpp_quant") else "")]


def _vllm_lines(result: dict[str, Any]) -> list[str]:
    v = result["engines"].get("vllm")
    if not v:
        return []
    return [f"- vLLM engine: vllm {v.get('vllm')} (torch {v.get('torch')}, transformers {v.get('transformers')}, "
            f"`{v.get('python')}`), dtype {v.get('dtype')}, max_num_seqs {v.get('max_num_seqs')}, "
            f"max_num_batched_tokens {v.get('max_num_batched_tokens')}, max_model_len {v.get('max_model_len')}, "
            f"KV blocks {v.get('num_kv_blocks')} of {v.get('block_size')}, prefix caching "
            f"{v.get('enable_prefix_caching')}, enforce_eager {v.get('enforce_eager')}, compilation "
            f"{v.get('compilation_mode')}; env {v.get('env_vars') or {}}"]


def _llamacpp_lines(result: dict[str, Any]) -> list[str]:
    v = result["engines"].get("llamacpp")
    if not v:
        return []
    status = next((s for s in result.get("peers", []) if s["peer"] == "llamacpp"), {})
    made = "; ".join(f"{name}: {info}" for name, info in (status.get("gguf_made") or {}).items())
    return [f"- llama.cpp engine: llama-cpp-python {v.get('llama_cpp_python')} (`{v.get('python')}`), GGUF "
            f"{v.get('gguf_type')} `{v.get('gguf')}` (checkpoint sha256 {str(status.get('checkpoint_sha256'))[:20]}"
            f"{'; ' + made if made else ''}), n_threads {v.get('n_threads')}, n_ctx {v.get('n_ctx')}, n_batch "
            f"{v.get('n_batch')}, n_seq_max {v.get('n_seq_max')}, {v.get('sampling')}; batched with the C API: one "
            f"llama_batch of all prompts (a seq_id each) for the prefill, then one llama_decode per step for all "
            f"sequences; system info `{v.get('system_info')}`"]


def _caveats(result: dict[str, Any]) -> str:
    w = result["workload"]
    measured = ("whole offline generate calls (prefill included) of a fixed batch of equal-length requests"
                if w["mode"] == "e2e" else
                "steady-state decode steps of a fixed batch whose KV is already at the set context (prefill "
                "untimed)")
    return (
        f"It shows {measured}, on this machine, for this checkpoint, with the same prompts, dtype and greedy "
        "decoding on both sides, EOS ignored so every request does the same work. Each point's figure is the "
        "median of one-iteration fresh processes run alternately per engine, so slow drift in the host's "
        "load hits both engines; the min–max range shows the spread, and a wide range means a noisy host, "
        "not a finding.\n\n"
        "It does not show latency under online load (`openinfer bench serve`), other models, other hardware "
        "or thread counts, or output quality (the benchmark checkpoint has random weights; with fixed "
        "lengths the work per step does not depend on the weights' values). HF `generate` is a floor "
        "baseline, not a serving engine: beating it says little about vLLM or llama.cpp, which are listed "
        "above as not run unless installed. Numbers from another host (such as those in cpu_peers.md) are "
        "not comparable with these.")


def write_markdown(result: dict[str, Any], path: Path) -> Path:
    metric = _metric(result)
    unit = "decode tok/s (batch x steps / window time)" if result["workload"]["mode"] == "decode" else \
        "output tok/s (batch x output tokens / generate time)"
    if metric.endswith("_per_device"):
        unit += f" per device ({result['environment']['num_devices']} devices)"
    parts = [
        f"# openinfer vs peers: {_TITLES[result['workload']['mode']]}",
        "",
        "![throughput vs batch size](throughput.png)",
        "",
        f"{workload_line(result)}. Cells: {unit}, median (min–max). Raw data: [peers.json](peers.json).",
        "",
        results_table(result),
        "",
        "## Peers",
        "",
        "| peer | status |",
        "|---|---|",
        *[_peer_line(s) for s in result.get("peers", [])],
        "",
        "## Environment",
        "",
        *_environment(result),
        "",
        "## What this does and does not show",
        "",
        _caveats(result),
    ]
    if result.get("notes"):
        parts += ["", "## Notes", "", *[f"- {n}" for n in result["notes"]]]
    path.write_text("\n".join(parts) + "\n")
    return path
