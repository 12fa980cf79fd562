"""A few launches of one kernel at benchmark inputs, to run under Nsight Compute (`ncu`).

  ncu --clock-control none --kernel-name regex:_moe_w --launch-skip 2 --launch-count 2 \\
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
      python bench/ncu_workload.py moe 9
  ncu --clock-control none --kernel-name regex:gluon --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
      python bench/ncu_workload.py mla 16 4096 33 [gluon|gluon_persistent|gluon_ws|gluon_seesaw|triton]

moe T: `int4_moe_triton` on the INT4 MoE benchmark's random layer with T tokens (bench_int4_moe.py);
moe_gluon T: `int4_moe_gluon` on the same shapes (its own random gluon-layout weights; kernels `_moe_w*_gluon_kernel`).
Both take `[POOL [BLOCK_PAIRS]]` after T: route only to the first POOL experts (crowded experts as in a verify step of
trees: T = 528, POOL = 202 puts ~21 pairs on each) and, for moe_gluon, the pairs per expert block.
moe_wgmma T [JSON]: `int4_moe_wgmma` (the sm_90 default) on the gluon-layout weights with its options as JSON (default:
auto_schedule; kernels `_moe_w13_wgmma_kernel`, `_moe_w2_wgmma_kernel`, `_moe_combine_kernel`, with '{"fused": true}'
at T = 1 `_moe_decode_kernel`), e.g.
  ncu --clock-control none --kernel-name regex:_moe_ --launch-skip 3 --launch-count 3 --section SpeedOfLight \
      --section WarpStateStats --section SchedulerStats python bench/ncu_workload.py moe_wgmma 1 '{"pdl": false}'
mla B L n [impl]: `mla_attention_triton` on the MLA benchmark's case (B sessions, prefix L, n-node trees);
impl gluon_persistent = gluon with persistent=True (kernel `_mla_fwd_gluon_persistent_kernel`).
Each runs its launcher three times (the first compiles), so skip two launches per kernel.
Run from the repo root with PYTHONPATH=. on a CUDA machine.
"""

from __future__ import annotations

import json
import sys

import torch


def moe(T: int, path: str = "triton", pool: int = 0, block_pairs: int = 0) -> None:
    from bench import bench_int4_moe as b
    from kernels.int4_moe import int4_moe_triton
    from kernels.int4_moe_gluon import int4_moe_gluon

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (b.gluon_layout_weights if path == "gluon" else b.gpu_layout_weights)(gen)
    ids, tw = b.routing(T, gen)
    if pool:
        ids = torch.rand(T, pool, generator=gen, device="cuda").topk(b.TOPK, dim=-1).indices
    x = torch.randn(T, b.D, generator=gen, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(x)
    kw = {"block_pairs": block_pairs} if path == "gluon" and block_pairs else {}
    for _ in range(3):
        (int4_moe_gluon if path == "gluon" else int4_moe_triton)(x, ids, tw, *w, out=out, **kw)


def mla(B: int, L: int, n: int, impl: str = "gluon") -> None:
    from bench.bench_mla_attention import SCALE, make_case
    from kernels.mla_attention import mla_attention_triton

    args, _, _ = make_case(B, L, n, torch.Generator().manual_seed(0), torch.Generator(device="cuda").manual_seed(0))
    out = torch.empty_like(args[0])
    persistent = impl == "gluon_persistent"
    for _ in range(3):
        mla_attention_triton(*args, SCALE, out=out, impl="gluon" if persistent else impl, persistent=persistent)


def moe_wgmma(T: int, options: str = "{}") -> None:
    from bench import bench_int4_moe as b
    from kernels.int4_moe_wgmma import int4_moe_wgmma

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = b.gluon_layout_weights(gen)
    ids, tw = b.routing(T, gen)
    x = torch.randn(T, b.D, generator=gen, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(x)
    for _ in range(3):
        int4_moe_wgmma(x, ids, tw, *w, out=out, **json.loads(options))


if __name__ == "__main__":
    kind, *rest = sys.argv[1:]
    if kind == "moe_wgmma":
        moe_wgmma(int(rest[0]), *rest[1:2])
    elif kind in ("moe", "moe_gluon"):
        T, pool, bp = (int(v) for v in [*rest, 0, 0][:3])
        moe(T, "gluon" if kind == "moe_gluon" else "triton", pool, bp)
    elif kind == "mla":
        mla(*(int(v) for v in rest[:3]), *rest[3:])
    else:
        raise SystemExit("usage: ncu_workload.py moe T | moe_gluon T | moe_wgmma T [JSON] | mla B L n [impl]")
    torch.cuda.synchronize()
