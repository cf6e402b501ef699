#!/usr/bin/env python
"""What the decode curve should look like (issue 41, must-show 4): per decode step, the work of the tiny V4 and
V4.1 ``curve`` checkpoints that grows with context and the work that does not, from their config.json.

    python scripts/decode_curve_model.py --ckpt-dir /tmp/c41 [--batch 8] [--contexts 4096,32768,131072]

Counted per request (1 + nextn = 4 verified positions, the queries) and summed over the batch:
- grows with context C: every index layer that scores (its own indexer) reads each visible index key once per
  request (the kernel's 4 queries of a request share each key tile) and scores it for each query: V4's CSA
  layers C/4 keys each; V4.1's C2 index sources C/2 each, its C1 candidate source C, a candidate-restricted C1
  layer at most ``candidate_topk_blocks x candidate_block_size``; V4's HCA layers attend every one of their C/128
  entries (head_dim wide) per query;
- independent of C: the sliding window (``sliding_window`` rows per layer and query), the top-k entries
  (``index_topk`` per compressed layer and query), the weights (the checkpoint's bytes, read once per step),
  the drafter (MTP / DSpark: a window layer).
Bytes are the model dtype's (bf16: the bench's ``kv_cache_dtype=auto``). Query-key scores count one per
(query, key) pair, whatever the heads: index scores are ``index_n_heads x index_head_dim`` MACs, HCA / window /
top-k scores ``num_attention_heads x head_dim``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BF16 = 2
QUERIES = 4  # 1 + nextn (3) verified positions per request and step


def _text(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def per_request(cfg: dict, context: int) -> dict[str, float]:
    """Per request and decode step: index keys read (bytes), index scores per query, HCA entries per query,
    fixed attention rows per query (window + top-k)."""
    t = _text(cfg)
    n = t["num_hidden_layers"]
    ratios = t["compress_ratios"][:n]
    key_b = t["index_head_dim"] * BF16
    entry_b = t["head_dim"] * BF16
    index_keys = hca_entries = fixed_rows = 0
    if "index_source_layer_ids" in t:  # V4.1: cross-layer sharing decides which layers score
        from openinfer.models.deepseek_v41.topology import SharedTopology

        topo = SharedTopology.build(tuple(ratios), n, t["kv_source_layer_ids"], t["index_source_layer_ids"],
                                    t.get("index_k_source_layer_ids"), t.get("candidate_source_layer_id"),
                                    t["candidate_topk_blocks"], t["candidate_block_size"], t["index_topk"])
        for layer, m in enumerate(ratios):
            fixed_rows += t["sliding_window"] + (t["index_topk"] if m else 0)
            if m and topo.index_source[layer] == layer:
                visible = context // m
                if topo.uses_candidates(layer):
                    visible = min(visible, topo.candidate_topk_blocks * topo.candidate_block_size)
                index_keys += visible
    else:  # V4: every CSA layer (ratio 4) has its indexer, HCA layers attend every entry
        for m in ratios:
            fixed_rows += t["sliding_window"]
            if m == 4:
                index_keys += context // 4
                fixed_rows += t["index_topk"]
            elif m:
                hca_entries += context // m
    return {"index_keys": index_keys, "index_key_bytes": index_keys * key_b, "hca_entries": hca_entries,
            "hca_bytes": hca_entries * entry_b, "fixed_rows": fixed_rows, "fixed_bytes": fixed_rows * entry_b}


def table(ckpt_dir: Path, batch: int, contexts: list[int]) -> list[dict]:
    rows = []
    for model in ("v4", "v41"):
        path = ckpt_dir / model
        cfg = json.loads((path / "config.json").read_text())
        weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        for c in contexts:
            r = per_request(cfg, c)
            rows.append({
                "model": model, "context": c, "batch": batch,
                # context-growing: index keys once per request, HCA entries once per request (its queries share)
                "growing_bytes": batch * (r["index_key_bytes"] + r["hca_bytes"]),
                "growing_scores": batch * QUERIES * (r["index_keys"] + r["hca_entries"]),
                # fixed: window + top-k rows per query (an upper bound: a request's queries overlap), weights once
                "fixed_bytes": batch * QUERIES * r["fixed_bytes"] + weights,
                "fixed_scores": batch * QUERIES * r["fixed_rows"],
            })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt-dir", default="/tmp/c41")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = ap.parse_args()
    rows = table(Path(args.ckpt_dir), args.batch, [int(c) for c in args.contexts.split(",")])
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| model | context | batch | growing MB / step | growing query-key scores / step | fixed MB / step "
          "| fixed query-key scores / step |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['context']:,} | {r['batch']} | {r['growing_bytes'] / 1e6:.1f} | "
              f"{r['growing_scores'] / 1e6:.2f} M | {r['fixed_bytes'] / 1e6:.1f} | {r['fixed_scores'] / 1e6:.3f} M |")


if __name__ == "__main__":
    main()
