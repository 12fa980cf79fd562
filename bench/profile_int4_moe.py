"""Per-kernel split of one MoE layer (align, w13, w2, combine) for the Triton default and the Gluon path, by
torch.profiler over CUDA-graph replays (Kimi K2.6 shapes, random weights and routing; issue 3).

  PYTHONPATH=. python bench/profile_int4_moe.py [--tokens 1 9 33] [--gluon-opts '{"depth": 2}']
                                                [--wgmma-opts '{"pdl": true}'] [--paths triton gluon wgmma]

Prints, per T and path, the mean device time of each kernel over 50 replays and the sum (with PDL, kernels
overlap: the sum then exceeds the layer's time); no records. The wgmma path runs on the gluon layout's random
words (same shapes at these K, as in bench_int4_moe).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import kernel_split_us  # noqa: E402
from bench.bench_int4_moe import gluon_layout_weights, gpu_layout_weights, routing  # noqa: E402
from kernels.int4_moe import int4_moe_triton  # noqa: E402
from kernels.int4_moe_gluon import int4_moe_gluon  # noqa: E402
from kernels.int4_moe_wgmma import int4_moe_wgmma  # noqa: E402

D = 7168


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 9, 33])
    ap.add_argument("--gluon-opts", default="{}", help="int4_moe_gluon options as JSON")
    ap.add_argument("--wgmma-opts", default="{}", help="int4_moe_wgmma options as JSON (default: auto_schedule)")
    ap.add_argument("--paths", nargs="+", default=["triton", "gluon", "wgmma"], choices=["triton", "gluon", "wgmma"])
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    wt, wg = gpu_layout_weights(gen), gluon_layout_weights(gen)
    opts = {"gluon": json.loads(args.gluon_opts), "wgmma": json.loads(args.wgmma_opts)}
    for T in args.tokens:
        ids, tw = routing(T, gen)
        x = torch.randn(T, D, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.empty_like(x)
        fns = {"triton": functools.partial(int4_moe_triton, x, ids, tw, *wt, out=out),
               "gluon": functools.partial(int4_moe_gluon, x, ids, tw, *wg, out=out, **opts["gluon"]),
               "wgmma": functools.partial(int4_moe_wgmma, x, ids, tw, *wg, out=out, **opts["wgmma"])}
        for name in args.paths:
            t = kernel_split_us(fns[name])
            parts = "  ".join(f"{k} {v:.1f}" for k, v in sorted(t.items(), key=lambda kv: -kv[1]))
            print(f"T={T:<4} {name:7} sum {sum(t.values()):7.1f} us  {parts}", flush=True)


if __name__ == "__main__":
    main()
