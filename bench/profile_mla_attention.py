"""Per-kernel split of one MLA tree-verify launch (the tile kernel, the combine) by torch.profiler over CUDA-graph
replays, Kimi K2.6 shapes (the inputs of bench_mla_attention.py; issue 3).

  PYTHONPATH=. python bench/profile_mla_attention.py [--impl gluon_seesaw gluon] [--cases 16:32768:65 1:1024:9]
      [--persistent off on]

Prints, per case and impl, the mean device time of each kernel over 50 replays, their sum and the kernels' share of
the floor's time; no records (the bench's records are the figures; this says where a launch's time goes).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import kernel_split_us, measure_ceilings  # noqa: E402
from bench.bench_mla_attention import DL, DR, SCALE, H, make_case  # noqa: E402
from kernels.mla_attention import IMPLS, mla_attention_triton  # noqa: E402

CASES = ("16:32768:65", "16:4096:65", "16:4096:9", "1:32768:1", "1:1024:9", "1:1024:1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", nargs="+", default=["gluon_seesaw", "gluon"], choices=IMPLS)
    ap.add_argument("--cases", nargs="+", default=list(CASES), help="batch:prefix:nodes")
    ap.add_argument("--persistent", nargs="+", default=["default"], choices=["default", "off", "on"],
                    help="the Gluon kernels' persistent form (mla_attention_triton(persistent=)), each in turn")
    args = ap.parse_args()
    ceil = measure_ceilings()
    gen = torch.Generator().manual_seed(0)
    cgen = torch.Generator(device="cuda").manual_seed(0)
    for case in args.cases:
        B, L, n = (int(v) for v in case.split(":"))
        inputs, _, depth = make_case(B, L, n, gen, cgen)
        nbytes = B * (L + n) * (DL + DR) * 2 + B * n * H * (DL + DR) * 2 + B * n * H * DL * 2
        flops = 2 * H * (DL + DR + DL) * float((L + depth + 1).sum())
        floor_us = max(nbytes / (ceil["copy_bw_GBps"] * 1e9), flops / (ceil["mm_tflops"] * 1e12)) * 1e6
        out = torch.empty_like(inputs[0])
        for impl in args.impl:
            for pers in args.persistent:
                kw = {} if pers == "default" else {"persistent": pers == "on"}
                t = kernel_split_us(functools.partial(mla_attention_triton, *inputs, SCALE, out=out, impl=impl, **kw))
                total = sum(t.values())
                parts = "  ".join(f"{k} {v:.1f}" for k, v in sorted(t.items(), key=lambda kv: -kv[1]))
                print(f"B={B:<3} L={L:<6} n={n:<3} {impl:13} persistent {pers:7} sum {total:9.1f} us  floor "
                      f"{floor_us:8.1f} us  ({floor_us / total:.2f})  {parts}", flush=True)
        del inputs, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
