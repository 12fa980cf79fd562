"""Print markdown tables from bench/results/*.jsonl (the latest record per configuration wins).

Usage: python bench/summarize.py [bench/results/int4_moe.jsonl bench/results/mla_attention.jsonl
                                  bench/results/verify_step.jsonl ...]
"""

from __future__ import annotations

import json
import sys


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def peers_str(peers: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in peers.items() if isinstance(v, float)) or "-"


def table(records: list[dict], keys: list[str], shown: tuple[str, ...] = ()) -> str:
    """One row per configuration (`keys` + config); `shown` are further params printed, not keyed."""
    latest = {}
    for r in records:
        p = r["params"]
        latest[(r["name"], json.dumps(p.get("config")), *(p.get(k, "-") for k in keys))] = r
    rows = [f"| {' | '.join([*keys, *shown])} | config | ms | floor ms | ratio | peers (ms) |",
            "|" + "---|" * (len(keys) + len(shown) + 5)]
    for (_, cfg, *vals), r in sorted(latest.items(), key=lambda kv: (kv[0][0], kv[0][1], *kv[0][2:])):
        vals += [r["params"].get(k, "-") for k in shown]
        rows.append(f"| {' | '.join(str(v) for v in vals)} | {json.loads(cfg)} | {r['ms']:.4f} | "
                    f"{r['floor_ms']:.4f} | {r['ratio']:.2f} | {peers_str(r['peers'])} |")
    head = records[-1]
    return (f"{head['gpu']}, torch {head['torch']}, triton {head['triton']}, commit {head['commit']}; "
            f"copy {head['copy_bw_GBps']:.0f} GB/s, bf16 matmul {head['mm_tflops']:.0f} TFLOP/s\n\n" + "\n".join(rows))


def main():
    paths = sys.argv[1:] or ["bench/results/int4_moe.jsonl", "bench/results/mla_attention.jsonl"]
    for path in paths:
        recs = load(path)
        name, shown = recs[0]["name"], ()
        if "int4" in name:
            keys = ["T", "experts_touched"]
        elif name == "verify_step":  # ms and floor are per decoder layer
            keys = ["layers", "batch", "prefix", "tree", "batch_invariant", "mla_kernel", "mla_persistent",
                    "mla_partials", "mla_fold"]
            shown = ("graph", "experts_touched_per_layer")
        else:
            keys = ["batch", "prefix", "tree", "chunk_rule", "impl", "page", "tma", "persistent", "partials", "fold",
                    "layers"]
        print(f"## {path}\n\n{table(recs, keys, shown)}\n")


if __name__ == "__main__":
    main()
