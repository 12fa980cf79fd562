"""Does the order in which the wgmma MoE kernels read an expert's weights cost DRAM bandwidth? A read-only peer.

The wgmma kernels (`kernels._int4_moe_wgmma`) give each program a tile of ROWS weight rows of one expert and walk K in
steps: a step reads W int32 words (256 int4 columns) of every row of the tile, rows KW words apart, plus the rows'
scales of the step. So a step touches ROWS short runs of 128 bytes spread over the tile. `tile_read` reads exactly a
tile's bytes with the kernels' grid and step count, XOR-folding them (no arithmetic, no shared memory), in one of two
orders:
- "rows": the kernels' order (each step a [ROWS, W] block of the tile's rows);
- "flat": the tile in address order (each step the next ROWS x W contiguous words).

Against each other in one run they say whether the kernels' order costs DRAM bandwidth (a step-major weight layout,
repacked at load, would read "flat"); against the copy floor and the contiguous read peer (`bench.expert_read`), how
far a read in this grid gets at all. `python bench/tile_read.py` times both at one token (the 8 experts of one routing,
w13 and w2 launches back to back in one CUDA graph) and writes JSON lines (`--out`).

Plain Triton, so it runs under TRITON_INTERPRET=1 on the CPU (tests/unit/test_tile_read.py against torch).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.expert_read import _xor  # noqa: E402

ORDERS = ("rows", "flat")


@triton.jit
def _step(wt, st, s, i, j, js, live, KW, KS, ROWS: tl.constexpr, W: tl.constexpr, SW: tl.constexpr,
          FLAT: tl.constexpr):
    """Step s of a tile: its words [ROWS, W] and scale words [ROWS, SW], in the kernels' order or (FLAT) the tile's
    address order."""
    if FLAT:
        wo = s * (ROWS * W) + i * W + j
        so = s * (ROWS * SW) + i * SW + js
    else:
        wo = i * KW + s * W + j
        so = i * KS + s * SW + js
    return tl.load(wt + wo, mask=live, other=0), tl.load(st + so, mask=live, other=0)


@triton.jit
def _tile_read_kernel(w_ptr, s_ptr, ids_ptr, out_ptr, N, KW, KS, stride_we, stride_se, ROWS: tl.constexpr,
                      W: tl.constexpr, SW: tl.constexpr, FLAT: tl.constexpr, UNROLL: tl.constexpr):
    """Program (row tile r, slot k): the XOR of expert ids[k]'s rows [r ROWS, (r + 1) ROWS) of the words [N, KW] and
    of the scales [N, KS] (int32 words), KW / W steps of W words (and SW scale words) of each row, in the kernels'
    order or (FLAT) the tile's address order, into out[k, r]. UNROLL steps' loads are issued before any is used (Triton
    does not pipeline loads that feed no dot: this is how many steps a program has in flight; the kernels' ring holds
    STAGES - 1 = 3)."""
    r = tl.program_id(0)
    k = tl.program_id(1)
    e = tl.load(ids_ptr + k).to(tl.int64)
    i = tl.arange(0, ROWS)[:, None]
    j = tl.arange(0, W)[None, :]
    js = tl.arange(0, SW)[None, :]
    live = (r * ROWS + i) < N
    wt = w_ptr + e * stride_we + r * ROWS * KW  # the tile: ROWS rows of KW words, contiguous
    st = s_ptr + e * stride_se + r * ROWS * KS
    acc = tl.zeros([ROWS, W], dtype=tl.int32)
    sacc = tl.zeros([ROWS, SW], dtype=tl.int32)
    tl.static_assert(UNROLL == 1 or UNROLL == 2 or UNROLL == 4)
    for s0 in range(0, KW // W, UNROLL):
        a0, b0 = _step(wt, st, s0, i, j, js, live, KW, KS, ROWS, W, SW, FLAT)
        if UNROLL > 1:
            a1, b1 = _step(wt, st, s0 + 1, i, j, js, live, KW, KS, ROWS, W, SW, FLAT)
        if UNROLL > 2:
            a2, b2 = _step(wt, st, s0 + 2, i, j, js, live, KW, KS, ROWS, W, SW, FLAT)
            a3, b3 = _step(wt, st, s0 + 3, i, j, js, live, KW, KS, ROWS, W, SW, FLAT)
        acc ^= a0
        sacc ^= b0
        if UNROLL > 1:
            acc ^= a1
            sacc ^= b1
        if UNROLL > 2:
            acc ^= a2 ^ a3
            sacc ^= b2 ^ b3
    folded = tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor) ^ tl.reduce(tl.reduce(sacc, 1, _xor), 0, _xor)
    tl.store(out_ptr + k * tl.num_programs(0) + r, folded)


def tile_read(words: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, order: str = "rows", rows: int = 128,
              out: torch.Tensor | None = None, warps: int = 4, unroll: int = 4) -> torch.Tensor:
    """words int32 [E, N, KW], scales int32 [E, N, KS] (the bf16 scales viewed as int32 pairs), ids [slots] int ->
    int32 [slots, N / rows]: each (slot, row tile)'s XOR of its bytes, read in `order` (ORDERS). KW is a multiple of
    32 words (the kernels' 256-column steps) and KS = KW / 8 (a row's 8 bf16 scales of a step: one 16-byte run). The
    kernels' w13 tile is 64 gate rows and the 64 up rows of the same columns, I rows further; here a tile is 128
    consecutive rows (the same runs per step, one region instead of two)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    E, N, KW = words.shape
    KS = scales.shape[2]
    if words.dtype != torch.int32 or scales.dtype != torch.int32 or scales.shape[:2] != (E, N):
        raise ValueError("tile_read: int32 words [E, N, KW] and int32 scales [E, N, KS]")
    if KW % (32 * unroll) or KS * 8 != KW or N % rows:
        raise ValueError(f"tile_read: KW ({KW}) a multiple of 32 x unroll ({unroll}), KS ({KS}) = KW / 8, N ({N}) a "
                         f"multiple of {rows}")
    if not (words.is_contiguous() and scales.is_contiguous()):
        raise ValueError("tile_read: contiguous tensors")
    grid = (N // rows, ids.numel())
    if out is None:
        out = torch.empty(grid[1], grid[0], dtype=torch.int32, device=words.device)
    _tile_read_kernel[grid](words, scales, ids, out, N, KW, KS, words.stride(0), scales.stride(0), ROWS=rows, W=32,
                            SW=4, FLAT=order == "flat", UNROLL=unroll, num_warps=warps)
    return out


def tile_read_ref(words: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, rows: int = 128) -> torch.Tensor:
    """What `tile_read` returns, in torch: the XOR of each (slot, row tile)'s words and scales."""
    out = []
    for e in ids.reshape(-1).tolist():
        w = words[e].reshape(-1, rows * words.shape[2]).cpu().numpy()
        s = scales[e].reshape(-1, rows * scales.shape[2]).cpu().numpy()
        out.append(np.bitwise_xor.reduce(w, axis=1) ^ np.bitwise_xor.reduce(s, axis=1))
    return torch.from_numpy(np.stack(out))


def main() -> None:
    from bench._common import env_info, graph_ms, measure_ceilings, write_jsonl
    from bench.bench_int4_moe import INTER, TOPK, D, best_read, gluon_layout_weights, routing

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/tile_read.jsonl")
    ap.add_argument("--unroll", type=int, nargs="+", default=[1, 4], help="steps in flight per program (1, 2, 4)")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--layers", type=int, default=8, help="routings timed back to back in one graph (per layer)")
    args = ap.parse_args()
    info, ceil = env_info(), measure_ceilings()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, w2, s2 = gluon_layout_weights(gen)
    tensors = [t if t.dtype == torch.int32 else t.contiguous().view(torch.int32) for t in (w13, s13, w2, s2)]
    routings = [routing(1, gen)[0].reshape(-1).to(torch.int32) for _ in range(args.layers)]
    per_expert = sum(t[0].numel() * t.element_size() for t in tensors)
    nbytes = sum(int(ids.unique().numel()) for ids in routings) * per_expert / args.layers
    floor_ms = nbytes / (ceil["copy_bw_GBps"] * 1e9) * 1e3
    read_ms = best_read((w13, s13, w2, s2), routings)[0] / args.layers
    print(f"{info['gpu']}: {nbytes / 1e6:.1f} MB a layer, floor {floor_ms * 1e3:.1f} us, contiguous read peer "
          f"{read_ms * 1e3:.1f} us ({floor_ms / read_ms:.3f})", flush=True)
    for unroll in args.unroll:
        for warps in args.warps:
            for order in ORDERS:
                calls = []
                for ids in routings:
                    for wt, st in ((tensors[0], tensors[1]), (tensors[2], tensors[3])):
                        run = functools.partial(tile_read, wt, st, ids, order, warps=warps, unroll=unroll)
                        calls.append(functools.partial(run, out=run()))
                ms = graph_ms(lambda calls=calls: [c() for c in calls]) / args.layers
                print(f"  {order:4s} unroll {unroll} warps {warps}: {ms * 1e3:7.1f} us a layer ({floor_ms / ms:.3f} of "
                      f"the copy floor, {read_ms / ms:.3f} of the contiguous read)", flush=True)
                write_jsonl(args.out, [dict(
                    name="tile_read", params=dict(T=1, E=w13.shape[0], D=D, I=INTER, topk=TOPK, layers=args.layers,
                                                  order=order, unroll=unroll, warps=warps, rows=128,
                                                  bytes=int(nbytes), timing="cuda_graph_replay_per_layer"),
                    **info, ms=ms, floor_ms=floor_ms, ratio=floor_ms / ms, peers={"read_experts": read_ms}, **ceil)])


if __name__ == "__main__":
    main()
