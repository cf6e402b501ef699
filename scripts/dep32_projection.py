"""Paper projection of DeepSeek's production decode shape (DEP32: data-parallel attention + expert parallelism on
32 GPUs, MTP nextn = 3, context 131,072) onto GB200-class links, computed from V4-Flash's released config.

  python scripts/dep32_projection.py            # the tables in docs/dep32_projection.md
  python scripts/dep32_projection.py --json     # the same figures as JSON

Every figure comes from the config below (spec §2, verbatim values) and the stated link/HBM assumptions, so
none is hand-typed. KV bytes per token are openinfer's own layout (the start-up report, built on the meta
device by scripts/kv_bytes_report.py) and vLLM's fp8_ds_mla layout (spec §5); see docs/dep32_projection.md
for what each figure means and which assumptions it rests on.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# DeepSeek-V4-Flash config.json, the fields the model reads (spec §2; same values as tests/test_deepseek_v4.py).
V4_FLASH = dict(
    architectures=["DeepseekV4ForCausalLM"], vocab_size=129280, hidden_size=4096, num_hidden_layers=43,
    num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
    sliding_window=128, compress_ratios=[0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)] + [0],
    compress_rope_theta=160000, rope_theta=10000, max_position_embeddings=1048576,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                  "beta_slow": 1},
    index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=6, moe_intermediate_size=2048, scoring_func="sqrtsoftplus", topk_method="noaux_tc",
    norm_topk_prob=True, routed_scaling_factor=1.5, num_hash_layers=3, swiglu_limit=10.0, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, num_nextn_predict_layers=1)


@dataclass(frozen=True)
class Shape:
    """The comparison's decode configuration (seed article) and the hardware assumptions of the projection."""
    gpus: int = 32                     # DEP32
    nextn: int = 3                     # MTP draft tokens per step
    context: int = 131072
    # GB200 NVL72: NVLink 5, 1.8 TB/s bidirectional per GPU = 900 GB/s each way; HBM3e 8 TB/s, 186 GB usable.
    nvlink_gbps: float = 900.0
    rdma_gbps: float = 50.0            # one 400 Gb/s NIC per GPU, for PD across racks
    hbm_tbps: float = 8.0
    hbm_gb: float = 186.0
    kv_share_of_free: float = 0.9      # of the memory left after weights (activations, graphs, fragmentation)


# -- MoE all-to-all per decode step ----------------------------------------------------------------------------
def dispatch_bytes_per_copy(hidden: int, fmt: str) -> int:
    """One token's activation sent to one expert: fp8 e4m3 with one fp32 scale per 128 values (DeepEP's FP8
    dispatch), or bf16."""
    if fmt == "fp8":
        return hidden + 4 * (hidden // 128)
    if fmt == "bf16":
        return 2 * hidden
    raise ValueError(f"dispatch format must be 'fp8' or 'bf16', got {fmt!r}")


def combine_bytes_per_copy(hidden: int) -> int:
    """One expert's output for one token sent back: bf16 (DeepSeek's production combine, spec §9)."""
    return 2 * hidden


def expected_ranks(experts: int, top_k: int, ranks: int) -> float:
    """Distinct EP ranks a token's top-k experts land on, experts spread evenly (experts/ranks per rank) and
    chosen uniformly: ranks * (1 - C(E - E/R, k) / C(E, k)). DeepEP's normal kernels send once per rank;
    its low-latency (decode) kernels send once per expert, i.e. top_k copies."""
    per = experts // ranks
    return ranks * (1 - math.comb(experts - per, top_k) / math.comb(experts, top_k))


def tokens_per_step(batch: int, nextn: int) -> tuple[int, int]:
    """(main-model tokens, MTP-layer tokens) one GPU runs per decode step at ``batch`` requests: the target
    verifies 1 + nextn tokens per request; the single MTP layer first runs over the verified positions, then
    nextn - 1 more single-token passes to chain the drafts (vLLM's MTP proposer)."""
    main = batch * (1 + nextn)
    return main, main + (nextn - 1) * batch


@dataclass(frozen=True)
class A2A:
    batch: int
    moe_layer_passes: int              # token-layer passes through an MoE layer per step (main + MTP)
    copies_per_token: float            # remote copies per token-layer (low-latency: top_k x (R-1)/R)
    dispatch_mb_fp8: float
    dispatch_mb_bf16: float
    combine_mb: float
    link_ms_fp8: float                 # (dispatch fp8 + combine) each way / NVLink one-way bandwidth


def all_to_all(cfg: dict, shape: Shape, batch: int) -> A2A:
    main, mtp = tokens_per_step(batch, shape.nextn)
    layers = cfg["num_hidden_layers"]
    passes = main * layers + mtp * cfg["num_nextn_predict_layers"]
    copies = cfg["num_experts_per_tok"] * (shape.gpus - 1) / shape.gpus  # the local rank's share stays on-GPU
    h = cfg["hidden_size"]
    d8, d16, comb = (passes * copies * b / 1e6 for b in (dispatch_bytes_per_copy(h, "fp8"),
                                                         dispatch_bytes_per_copy(h, "bf16"),
                                                         combine_bytes_per_copy(h)))
    # Balanced experts: what a GPU sends out equals what it receives, in each phase; both phases use the
    # same one-way link, one after the other.
    return A2A(batch, passes, copies, d8, d16, comb, (d8 + comb) / shape.nvlink_gbps)  # MB / (GB/s) = ms


# -- KV bytes --------------------------------------------------------------------------------------------------
def _kv_report_module():
    spec = importlib.util.spec_from_file_location("kv_bytes_report", ROOT / "scripts" / "kv_bytes_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def openinfer_kv(cfg: dict, kv_cache_dtype: str, block_size: int = 64) -> dict:
    """openinfer's layout, from the model's own kv_cache_spec on the meta device (the start-up report):
    whole-life bytes per token and the bytes a running sequence holds for its sliding stores."""
    import torch

    from openinfer.kv_cache_interface import bytes_per_token, sliding_bytes_per_seq

    mod = _kv_report_module()
    groups = mod._spec(cfg, torch.bfloat16, block_size, kv_cache_dtype)
    return {"bytes_per_token": bytes_per_token(groups, block_size),
            "sliding_bytes_per_seq": sum(sliding_bytes_per_seq(g, block_size) for g in groups if g.sliding),
            "summary": mod.kv_bytes_summary(groups, block_size)}


def vllm_fp8_ds_mla_kv(cfg: dict) -> dict:
    """vLLM's fp8_ds_mla layout (spec §5): a 512-d entry is 584 B (448 fp8 + 64 bf16 rope + 8 scale/pad),
    an indexer key 132 B (128 fp8 + fp32 scale); per layer a 128-token SWA ring; CSA: an entry and an indexer
    key per 4 tokens; HCA: an entry per 128 tokens. Per sequence also the fp32 compressor state: kv + score of
    the last coff * m tokens (C4: 8 tokens x 2 x 512 wide, plus the indexer's 8 x 2 x 128; C128: 128 x 512)."""
    entry, key = 584, 132
    layers = cfg["num_hidden_layers"]
    ratios = cfg["compress_ratios"][:layers]
    d, idim = cfg["head_dim"], cfg["index_head_dim"]
    per_token = sum((entry + (key if m == 4 else 0)) / m for m in ratios if m)
    ring = layers * cfg["sliding_window"] * entry
    state = sum(2 * 4 * (2 * m * 2 * d + 2 * m * 2 * idim if m == 4 else m * d) for m in ratios if m)
    return {"bytes_per_token": per_token, "ring_bytes_per_seq": ring, "state_bytes_per_seq": state}


def kv_per_request(per_token: float, per_seq: float, context: int) -> float:
    return per_token * context + per_seq


# -- attention bytes read per decode step (what a flat curve would need) ------------------------------------------
def attention_read_bytes(cfg: dict, context: int, entry: int = 584, key: int = 132) -> dict:
    """KV bytes one request's decode step reads, fp8_ds_mla sizes: SWA window in every layer; CSA reads its
    top-k entries (flat in context) but scores every visible indexer key (linear); HCA reads every entry
    (linear, 1/128)."""
    layers = cfg["num_hidden_layers"]
    ratios = cfg["compress_ratios"][:layers]
    w = cfg["sliding_window"] * entry
    csa = [m for m in ratios if m == 4]
    hca = [m for m in ratios if m and m != 4]
    out = {
        "window": layers * w,
        "csa_topk": len(csa) * min(cfg["index_topk"], context // 4) * entry,
        "indexer_keys": len(csa) * (context // 4) * key,
        "hca_entries": sum(context // m for m in hca) * entry,
    }
    out["total"] = sum(out.values())
    return out


# -- KV capacity per GPU -----------------------------------------------------------------------------------------
def weight_bytes_per_gpu(cfg: dict, gpus: int) -> dict:
    """V4-Flash's release storage (spec §2/§3): routed experts MXFP4 (0.5 B + one e8m0 byte per 32 values),
    the other linears fp8 with per-128x128 block scales (~1 B), embed/head bf16. Attention and the shared expert
    are replicated on every DP rank; routed experts are split over the EP ranks."""
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]
    inter, E = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    H, d, ql, og, ol = (cfg[k] for k in ("num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
                                         "o_lora_rank"))
    attn = h * ql + ql * H * d + h * d + og * ol * (H * d // og) + h * og * ol  # wq_a, wq_b, wkv, wo_a, wo_b
    # CSA: compressor (2 x 2d rows) + indexer (wq_b, weights_proj, its compressor); HCA: compressor (2 x d rows).
    ratios = cfg["compress_ratios"][:cfg["num_hidden_layers"]]
    ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
    extra = sum((2 * 2 * d * h + ql * ih * idim + ih * h + 2 * 2 * idim * h) * 2 if m == 4 else
                (2 * d * h) * 2 if m else 0 for m in ratios)  # bf16 in the checkpoint
    shared = 3 * h * inter * cfg["n_shared_experts"]
    routed = 3 * h * inter * E * (0.5 + 1 / 32)
    embed_head = 2 * cfg["vocab_size"] * h * 2
    replicated = L * (attn + shared) + extra + embed_head
    return {"replicated_gb": replicated / 1e9, "routed_total_gb": L * routed / 1e9,
            "per_gpu_gb": (replicated + L * routed / gpus) / 1e9}


# -- PD transfer: NIXL pull vs push ------------------------------------------------------------------------------
def pd_transfer(kv_bytes: float, shape: Shape, block_tokens: int = 64, stores_per_layer: float = 3.0,
                layers: int = 43) -> dict:
    """One 131k-token request's KV moved prefill -> decode. Pull (decode READs after the prefill has finished
    and answered): the whole transfer is exposed after prefill, and the prefill holds the blocks until the
    decode side says it is done. Push (prefill WRITEs as its chunks complete): all but the last chunk's transfer
    overlaps prefill compute, and the blocks are freed when the write completes. Descriptors: one RDMA op per
    (block, store, layer), openinfer/vLLM style."""
    descriptors = math.ceil(shape.context / block_tokens) * stores_per_layer * layers
    return {"kv_mb": kv_bytes / 1e6, "nvlink_ms": kv_bytes / (shape.nvlink_gbps * 1e6),
            "rdma_ms": kv_bytes / (shape.rdma_gbps * 1e6), "descriptors": int(descriptors),
            "bytes_per_descriptor": kv_bytes / descriptors}


def seed_check(shape: Shape, kv_bytes_per_token: float) -> dict:
    """The comparison's 141K -> 440K tok/s/GPU (AgentX, cached + uncached input + output counted): the KV
    bandwidth each would need if every counted token's KV crossed the PD link once (an upper bound: cached
    tokens' KV mostly stays put), as a share of one GPU's NVLink and NIC."""
    out = {}
    for name, tps in (("pull_141k", 141e3), ("push_440k", 440e3)):
        gbps = tps * kv_bytes_per_token / 1e9
        out[name] = {"tok_s_gpu": tps, "kv_gb_s": gbps, "share_nvlink": gbps / shape.nvlink_gbps,
                     "share_rdma": gbps / shape.rdma_gbps}
    return out


def projection(batches: tuple[int, ...] = (8, 16, 32, 64, 128, 256), shape: Shape = Shape()) -> dict:
    cfg = V4_FLASH
    oi = {k: openinfer_kv(cfg, k) for k in ("auto", "fp8")}
    vl = vllm_fp8_ds_mla_kv(cfg)
    per_req = {
        "openinfer_bf16": kv_per_request(oi["auto"]["bytes_per_token"], oi["auto"]["sliding_bytes_per_seq"],
                                         shape.context),
        "openinfer_fp8": kv_per_request(oi["fp8"]["bytes_per_token"], oi["fp8"]["sliding_bytes_per_seq"],
                                        shape.context),
        "vllm_fp8_ds_mla": kv_per_request(vl["bytes_per_token"], vl["ring_bytes_per_seq"] + vl["state_bytes_per_seq"],
                                          shape.context),
    }
    weights = weight_bytes_per_gpu(cfg, shape.gpus)
    free = (shape.hbm_gb - weights["per_gpu_gb"]) * shape.kv_share_of_free * 1e9
    reads = {c: attention_read_bytes(cfg, c) for c in (4096, 16384, 32768, 65536, 131072)}
    return {
        "shape": asdict(shape),
        "dispatch_bytes_per_copy": {"fp8": dispatch_bytes_per_copy(cfg["hidden_size"], "fp8"),
                                    "bf16": dispatch_bytes_per_copy(cfg["hidden_size"], "bf16")},
        "combine_bytes_per_copy": combine_bytes_per_copy(cfg["hidden_size"]),
        "expected_ranks_per_token": expected_ranks(cfg["n_routed_experts"], cfg["num_experts_per_tok"], shape.gpus),
        "all_to_all": [asdict(all_to_all(cfg, shape, b)) for b in batches],
        "kv_openinfer": oi,
        "kv_vllm_fp8_ds_mla": vl,
        "kv_bytes_per_request": per_req,
        "weights": weights,
        "kv_requests_per_gpu": {k: free / v for k, v in per_req.items()},
        "attention_read_bytes_per_request_step": reads,
        "attention_read_ms_batch256_131k": 256 * reads[131072]["total"] / (shape.hbm_tbps * 1e9),
        "pd_transfer": pd_transfer(per_req["vllm_fp8_ds_mla"], shape),
        "seed_check": seed_check(shape, vl["bytes_per_token"]),
    }


def _fmt(p: dict) -> str:
    lines = [f"dispatch bytes per token-expert copy: fp8 {p['dispatch_bytes_per_copy']['fp8']}, "
             f"bf16 {p['dispatch_bytes_per_copy']['bf16']}; combine (bf16) {p['combine_bytes_per_copy']}",
             f"expected distinct EP ranks per token (top-6 of 256 on 32): {p['expected_ranks_per_token']:.3f}",
             "", "| batch/GPU | MoE token-layer passes | dispatch fp8 MB | dispatch bf16 MB | combine MB | "
             "NVLink ms (fp8 + combine) |", "|---|---|---|---|---|---|"]
    for a in p["all_to_all"]:
        lines.append(f"| {a['batch']} | {a['moe_layer_passes']} | {a['dispatch_mb_fp8']:.1f} | "
                     f"{a['dispatch_mb_bf16']:.1f} | {a['combine_mb']:.1f} | {a['link_ms_fp8']:.3f} |")
    lines += ["", f"openinfer KV (bf16): {p['kv_openinfer']['auto']['summary']}",
              f"openinfer KV (fp8): {p['kv_openinfer']['fp8']['summary']}",
              f"vLLM fp8_ds_mla KV: {p['kv_vllm_fp8_ds_mla']['bytes_per_token']:.1f} bytes/token + "
              f"{p['kv_vllm_fp8_ds_mla']['ring_bytes_per_seq']} bytes SWA ring + "
              f"{p['kv_vllm_fp8_ds_mla']['state_bytes_per_seq']} bytes compressor state per sequence", ""]
    for k, v in p["kv_bytes_per_request"].items():
        lines.append(f"KV per request at {p['shape']['context']}: {k} {v / 1e6:.1f} MB -> "
                     f"{p['kv_requests_per_gpu'][k]:.0f} requests per GPU")
    w = p["weights"]
    lines.append(f"weights per GPU: {w['per_gpu_gb']:.1f} GB ({w['replicated_gb']:.1f} GB replicated + "
                 f"{w['routed_total_gb']:.1f} GB routed experts / {p['shape']['gpus']})")
    lines += ["", "| context | window MB | CSA top-k MB | indexer keys MB | HCA MB | total MB per request-step |",
              "|---|---|---|---|---|---|"]
    for c, r in p["attention_read_bytes_per_request_step"].items():
        lines.append(f"| {c} | {r['window'] / 1e6:.2f} | {r['csa_topk'] / 1e6:.2f} | {r['indexer_keys'] / 1e6:.2f} "
                     f"| {r['hca_entries'] / 1e6:.2f} | {r['total'] / 1e6:.2f} |")
    lines.append(f"KV read at batch 256, 131072: {p['attention_read_ms_batch256_131k']:.2f} ms per step at "
                 f"{p['shape']['hbm_tbps']} TB/s")
    t = p["pd_transfer"]
    lines += ["", f"PD transfer of one request (vLLM layout): {t['kv_mb']:.1f} MB, {t['nvlink_ms']:.2f} ms on "
              f"NVLink, {t['rdma_ms']:.2f} ms on a 400G NIC, {t['descriptors']} descriptors of "
              f"{t['bytes_per_descriptor'] / 1e3:.1f} KB"]
    for k, v in p["seed_check"].items():
        lines.append(f"seed {k}: {v['kv_gb_s']:.2f} GB/s of KV per GPU if every counted token crossed once = "
                     f"{100 * v['share_nvlink']:.2f}% of NVLink, {100 * v['share_rdma']:.1f}% of a 400G NIC")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    p = projection()
    print(json.dumps(p, indent=2) if args.json else _fmt(p))


if __name__ == "__main__":
    main()
