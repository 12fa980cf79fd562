"""A cost model of the MLA verify launch fitted to `bench_mla_attention.py` records: what the grid kernel can reach.

The default launch (the seesaw grid kernel, then the combine kernel) runs one program per (query tile, KV chunk)
item, one program per SM at a time (224 KB of shared memory each), dispatched in grid order (x = query tile
fastest, so chunk 0 of every tile first). The model prices an item at `tiles * t_tile + x_item`: its 64-key tiles
plus a fixed cost (the query tile's load, the pipeline's fill and drain, the partial's store, the program's start
and exit), places the items on the SMs greedily in that order (the first free SM takes the next), adds the combine
kernel as a read of every item's partial and a write of every tile's output at the record's copy bandwidth (bf16
partials, 64 rows x 512 values), and a constant per launch (`--launch-us`, 10 by default: two kernels replayed
from a CUDA graph; 0 fits it too, and it then soaks up the model's misses). It fits (t_tile, x_item) to the records
of one batch size by least squares and prints each case beside the model, then the model's relative change, applied
to the measured time, with no combine (partials reduced on chip), with another base chunk size (`--c-min`) and with
both, and the largest fixed cost per item that would give a ratio of `--target`.

The trees are random recursive trees like the bench's (node i's parent uniform over 0..i-1), drawn here with their
own seed: their depths only move a row's last chunk by a tile. Scope: launches that fill the GPU (batch 16). A batch-1
launch has fewer items than SMs and each program runs its own chain of tile latencies (the forty-fifth session
measured ~4 us a tile alone against ~1.9 us here): the model does not describe it.

Run:  python bench/mla_item_model.py bench/results/mla_attention_last_run2_h100_session47.jsonl [--batch 16]
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import random

import numpy as np

from kernels.mla_attention import chunk_spans

ROWS, VALUES, PARTIAL_BYTES = 64, 512, 2  # a query tile's rows (one token's heads), value columns, bf16 partials


def tree_depths(n: int, rng: random.Random) -> list[int]:
    """Depths of a random recursive tree of n nodes (node i's parent uniform over 0..i-1), as the bench draws them."""
    depth = [0]
    for i in range(1, n):
        depth.append(depth[rng.randrange(i)] + 1)
    return depth


@functools.cache  # (the fit and the what-ifs ask for the same launches many times)
def launch_items(batch: int, prefix: int, nodes: int, *, c_min: int, chunk_rule: str = "balanced",
                 block_n: int = 64, seed: int = 0) -> tuple[tuple[int, ...], int]:
    """-> (tiles of each item in grid order, query tiles): one query tile per node, a session's nodes at
    positions prefix + depth, each cut into the kernel's own chunks (`chunk_spans`)."""
    rng = random.Random(seed)
    spans = [chunk_spans(prefix + d, chunk_rule, block_n, c_min=c_min)
             for _ in range(batch) for d in tree_depths(nodes, rng)]
    grid_c = max(len(s) for s in spans)
    items = tuple(-(-s[c][1] // block_n) - s[c][0] // block_n for c in range(grid_c) for s in spans if c < len(s))
    return items, len(spans)


def makespan(items: tuple[int, ...] | list[int], t_tile: float, x_item: float, sms: int) -> tuple[float, int, int]:
    """Greedy list schedule in order -> (makespan, tiles and items on the SM that finishes last)."""
    free = [(0.0, i, 0, 0) for i in range(sms)]  # (busy until, SM, tiles, items)
    for n in items:
        t, sm, tiles, count = heapq.heappop(free)
        heapq.heappush(free, (t + n * t_tile + x_item, sm, tiles + n, count + 1))
    end, _, tiles, count = max(free)
    return end, tiles, count


def combine_us(items: int, tiles: int, copy_gbps: float) -> float:
    """The combine kernel as bandwidth: every item's partial read, every tile's output written (0 for one chunk)."""
    if items == tiles:
        return 0.0
    return (items + tiles) * ROWS * VALUES * PARTIAL_BYTES / (copy_gbps * 1e3)


def predict(case: dict, fit: tuple[float, float, float], sms: int, *, c_min: int | None = None,
            combine: bool = True) -> float:
    t_tile, x_item, launch = fit
    items, tiles = launch_items(case["batch"], case["prefix"], case["tree"], c_min=c_min or case["c_min"])
    span = makespan(items, t_tile, x_item, sms)[0]
    return span + launch + (combine_us(len(items), tiles, case["copy_gbps"]) if combine else 0.0)


def fit_model(cases: list[dict], sms: int, launch: float | None = None, rounds: int = 20) -> tuple[float, float, float]:
    """Least squares for (t_tile, x_item) and, when `launch` is None, the constant per launch: the makespan is linear
    in (t_tile, x_item) for a fixed critical SM, so alternate between finding each case's critical SM and solving the
    linear problem."""
    sol = np.array([2.0, 5.0] + ([0.0] if launch is None else []))
    for _ in range(rounds):
        rows, rhs = [], []
        for c in cases:
            items, tiles = launch_items(c["batch"], c["prefix"], c["tree"], c_min=c["c_min"])
            _, n_tiles, n_items = makespan(items, sol[0], sol[1], sms)
            rows.append([n_tiles, n_items] + ([1.0] if launch is None else []))
            rhs.append(c["us"] - combine_us(len(items), tiles, c["copy_gbps"]) - (launch or 0.0))
        new = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0]
        if np.allclose(new, sol, rtol=1e-6, atol=1e-9):
            break
        sol = new
    return float(sol[0]), float(sol[1]), float(sol[2]) if launch is None else launch


def load_cases(paths: list[str], batch: int) -> list[dict]:
    """One case per (prefix, tree, c_min) of the default launch (the seesaw grid kernel, named or as "auto" picks it
    on sm_90; the combine launch; the balanced rule; a table as wide as the case), the latest record winning."""
    cases = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                p = r["params"]
                if (r["name"] != "mla_attention" or p["batch"] != batch or p.get("combine", "launch") != "launch"
                        or p.get("impl") not in ("gluon_seesaw", "auto")
                        or p.get("persistent") not in (None, "default", "off")
                        or p.get("chunk_rule", "balanced") != "balanced"
                        or p.get("table_len", 0) > p["prefix"] + p["tree"] + 64 * 2):  # a serving table's slots
                    continue
                config = p.get("config")  # "default" or the swept knobs
                c_min = config.get("c_min", 512) if isinstance(config, dict) else 512
                cases[(p["prefix"], p["tree"], c_min)] = dict(
                    batch=batch, prefix=p["prefix"], tree=p["tree"], c_min=c_min, us=r["ms"] * 1e3,
                    floor_us=r["floor_ms"] * 1e3, copy_gbps=r["copy_bw_GBps"])
    return [cases[k] for k in sorted(cases)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="bench_mla_attention.py JSONL files")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--c-min", type=int, default=1024, help="the what-if base chunk size")
    ap.add_argument("--target", type=float, default=0.70)
    ap.add_argument("--launch-us", type=float, default=10.0,
                    help="the constant per launch (two kernels replayed from a graph; <= 0: fit it too)")
    args = ap.parse_args()
    cases = load_cases(args.paths, args.batch)
    if len(cases) < 3:
        raise SystemExit(f"mla_item_model: {len(cases)} default-launch records of batch {args.batch}; need 3 or more")
    fit = fit_model(cases, args.sms, args.launch_us if args.launch_us > 0 else None)
    t_tile, x_item, launch = fit
    print(f"fit over {len(cases)} cases: t_tile {t_tile:.2f} us, x_item {x_item:.2f} us, launch {launch:.1f} us")
    print(f"| prefix | nodes | c_min | measured us (ratio) | model us (error) | no combine | c_min {args.c_min} "
          f"| c_min {args.c_min}, no combine | x_item for {args.target:.2f} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in cases:
        model = predict(c, fit, args.sms)
        cells = []
        for kw in (dict(combine=False), dict(c_min=args.c_min), dict(c_min=args.c_min, combine=False)):
            change = predict(c, fit, args.sms, **kw) / model  # scales the measured time
            cells.append(f"{change - 1:+.0%} ({c['floor_us'] / (c['us'] * change):.2f})")
        need = _x_for(c, fit, args.sms, c["floor_us"] / args.target * model / c["us"])
        print(f"| {c['prefix']} | {c['tree']} | {c['c_min']} | {c['us']:.1f} ({c['floor_us'] / c['us']:.2f}) | "
              f"{model:.1f} ({model / c['us'] - 1:+.0%}) | {' | '.join(cells)} | {need} |")


def _x_for(case: dict, fit: tuple[float, float, float], sms: int, budget_us: float) -> str:
    """The largest fixed cost per item (combine kept) whose predicted time meets budget_us, by bisection."""
    t_tile, _, launch = fit
    if predict(case, (t_tile, 0.0, launch), sms) > budget_us:
        return "unreachable"
    lo, hi = 0.0, 100.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predict(case, (t_tile, mid, launch), sms) <= budget_us else (lo, mid)
    return f"{lo:.1f} us"


if __name__ == "__main__":
    main()
