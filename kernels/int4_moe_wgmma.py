"""wgmma path of `kernels.int4_moe` (sm_90): its weight layout ("wgmma"), made once at load, and its launcher.

Same op and launches as the other paths (`moe_align` into blocks of `block_pairs` pairs, w13 with SiLU(gate) * up
fused, w2 into per-pair fp32 rows, the slot-ordered combine); the GEMMs are `_int4_moe_wgmma`'s (dequantised
weights as the register A operand of warpgroup MMAs, the block's activations as the shared-memory B operand). Same
arithmetic as the Triton default (bf16(q * s) weights, fp32 accumulation, `a` rounded to bf16) in natural K order,
other bits than the other two paths; batch invariant. GPU only (Gluon has no interpreter): the CPU tests check the
layout against the checkpoint (`wgmma_layout_dense`).

"wgmma" layout (`repack_int4_moe_for_wgmma`), per projection: K padded to a multiple of 256 (zero weights, zero
scales), words int32 [E, N, Kp/8], scales bf16 [E, N, Kp/32] (the checkpoint's, padded). In each 256-column step
of a row, memory word 8 t + j holds the columns 32 j + 16 i1 + 8 i0 + 2 t + b (quantisation group j of the step)
at nibble position i + 4 b, i = i0 + 2 i1, so `(word >> 4 i) & 0x000F000F` is the column pair b = 0, 1 of i.

"wgmma_steps" layout (`to_step_major`, after the above): the same tensors, shapes, words and scales with each
expert's block in step-major order: the 32 words of step kb of row n at word (kb * N + n) * 32 of the expert
(`words.view(E, Kp/256, N, 32)`), its 8 scales at (kb * N + n) * 8. A program's rows of one step are then one
contiguous run (64 rows of a tensor: 8 KB of words, 1 KB of scales) instead of 64 runs of 128 bytes and 64 of 16
bytes Kp/2 and Kp/16 bytes apart: fewer DRAM pages and L2 sectors a step, and coalesced scale copies. The kernels
read either through the strides they are given (`_layout_strides`): the same arithmetic, the same bits.
"""

from __future__ import annotations

import functools

import torch

from kernels._int4_moe_decode import DECODE_MAXNREG, _moe_decode_kernel
from kernels._int4_moe_wgmma import (
    HAVE_GLUON,
    _moe_w2_combine_wgmma_kernel,
    _moe_w2_wgmma_kernel,
    _moe_w13_wgmma_kernel,
)
from kernels._int4_moe_ws import WS_MAXNREG, _moe_ws_kernel, ws_descriptors
from kernels._moe_frame import routed_moe
from kernels.int4_pack import PACK_FACTOR, permute_steps

STEP = 256  # K columns per kernel step (and the K padding)
BLOCK_PAIRS = (8, 16, 32, 64)  # pairs per expert block; every size gives the same bits (GPU test)
STAGES = (2, 3, 4)  # ring slots: weights, scales and activations of STAGES - 1 steps in flight
DEFAULT_SCHEDULE = {}  # read at each call: `int4_moe_wgmma` options for every launch (the rest: as `resolve_schedule`)
ROW_TILES = (1, 2, 4, 8)  # w2 row tiles (of `rows` rows) per program, one after the other through one ring
WARPGROUPS = (1, 2)  # warpgroups per program: 1 does both weight tensors' 64 rows, 2 split them (one tensor each)
ROWS = (128, 64)  # weight rows per program: 64 gate + 64 up rows (w13) / 128 output rows (w2), or half that
WS = (False, True, "graphs")  # the warp-specialized one-token GEMMs: never, always, only inside a CUDA-graph capture
PLAIN = dict(block_pairs=8, small_pairs=0, stages=2, maxnreg=None, pdl=False, direct=False, row_tiles=1,
             warpgroups=1, fused=False, rows=128, w2_combine=False, ws=False, ws_stages=2,
             ws_row_tiles=1)  # one block size
SYNC_WORDS = 256  # counters per device and use: the fused decode's ticket, exits, ready[topk], rows_done[row ranges];
# w2_combine's row-range counts
SMALL_LAUNCH = 128  # pairs: the largest launch of auto_schedule's middle tier
MAXNREG = 168  # the tiered schedule's register cap: 3 CTAs per SM (171 uncapped; no spills at 168 with Triton 3.6)
LAYOUTS = ("wgmma", "wgmma_steps")  # the weight orders the kernels read (module doc)


def auto_schedule(pairs: int) -> dict:
    """Launch options for `pairs` (token, expert) pairs. Decode (<= 8 pairs: every expert has one small block, and
    the GPU holds all CTAs at once): 8-pair blocks, a 4-slot ring, whose depth hides the memory latency, `direct`
    (one token: a block per pair straight from the routing, no grouping launch) and `pdl` (programmatic dependent
    launch of w13, w2 and the combine: each grid scheduled while the previous one ends, w2's first weight steps in
    flight before w13 is done). PDL only there: with more CTAs than fit at once, w2's early CTAs hold slots that
    w13's later waves need (H200, 33-129 tokens: 1-28% slower, erratic run to run). Up to SMALL_LAUNCH pairs (a few
    tokens, a 9-node tree): 16-pair blocks of which the ones holding <= 8 pairs run with N = 8, a 2-slot ring and
    <= 128 registers, 4 CTAs per SM. More pairs: 32-pair blocks with the same small path under MAXNREG registers,
    3 CTAs per SM (uniform routing puts 1-3 pairs on an expert, a verify step's tree tokens crowd some experts with
    dozens: an expert's weights are streamed once per block). Only speed depends on it: the bits do not (GPU
    test). One token inside a CUDA-graph capture: the warp-specialized GEMMs (`ws`, 2 slots: H100, 1-2% faster than
    the ring at 4 slots, whose depth they need no longer; eagerly the ring, since the ws kernels' TMA descriptors
    are encoded on the host at each launch: 30-60 us a layer, paid once in a graph), w2 with 2 row tiles a program
    (224 programs of 16 steps, one wave, instead of 448 of 8: H100, 0.6-1.2% faster than 1 tile, 4 tiles slower)."""
    if pairs <= 8:
        return {**PLAIN, "stages": 4, "pdl": True, "direct": True, "ws": "graphs", "ws_stages": 2, "ws_row_tiles": 2}
    if pairs <= SMALL_LAUNCH:
        return {**PLAIN, "block_pairs": 16, "small_pairs": 8, "maxnreg": 128}
    return {**PLAIN, "block_pairs": 32, "small_pairs": 8, "maxnreg": MAXNREG}


def resolve_schedule(pairs: int, **given) -> dict:
    """The schedule a launch of `pairs` pairs runs: the options given (None: not given) over DEFAULT_SCHEDULE's, over
    `auto_schedule`'s, or over PLAIN's when a block size is among them; ValueError for one the kernels cannot run.
    Two warpgroups drop auto_schedule's register cap unless one is given: its caps size 4-warp programs (3 or 4 per
    SM), and uncapped the 8-warp ones stay within 128 registers, two per SM (sm_90 compile test)."""
    chosen = {**DEFAULT_SCHEDULE, **{k: v for k, v in given.items() if v is not None}}
    if set(chosen) - set(PLAIN):
        raise ValueError(f"int4_moe_wgmma: unknown schedule options {sorted(set(chosen) - set(PLAIN))}, the options "
                         f"are {sorted(PLAIN)}")
    sched = {**(PLAIN if chosen.get("block_pairs") else auto_schedule(pairs)), **chosen}
    if sched["warpgroups"] == 2 and "maxnreg" not in chosen:
        sched["maxnreg"] = None
    bp, small, stages, cap = sched["block_pairs"], sched["small_pairs"], sched["stages"], sched["maxnreg"]
    if (bp not in BLOCK_PAIRS or stages not in STAGES or (small and (small not in BLOCK_PAIRS or small >= bp))
            or not any(sched["ws"] is m or (isinstance(m, str) and sched["ws"] == m) for m in WS)
            or sched["ws_stages"] not in STAGES or isinstance(sched["ws_stages"], bool)
            or not (cap is None or (isinstance(cap, int) and 32 <= cap <= 255))
            or not all(isinstance(sched[k], bool) for k in ("pdl", "direct", "fused", "w2_combine"))
            or any(sched[k] not in allowed or isinstance(sched[k], bool)
                   for k, allowed in (("row_tiles", ROW_TILES), ("ws_row_tiles", ROW_TILES), ("warpgroups", WARPGROUPS),
                                      ("rows", ROWS)))
            or (sched["rows"] == 64 and sched["warpgroups"] != 1)):
        raise ValueError(f"int4_moe_wgmma: block_pairs={bp} (one of {BLOCK_PAIRS}), small_pairs={small} "
                         f"(0 or a smaller one), stages={stages} (one of {STAGES}), maxnreg={cap} (None or 32-255), "
                         f"pdl={sched['pdl']!r}, direct={sched['direct']!r}, fused={sched['fused']!r}, "
                         f"w2_combine={sched['w2_combine']!r} (true / false), ws={sched['ws']!r} (one of {WS}), "
                         f"ws_stages={sched['ws_stages']!r} (one of {STAGES}), "
                         f"ws_row_tiles={sched['ws_row_tiles']!r} (one of {ROW_TILES}), "
                         f"row_tiles={sched['row_tiles']!r} (one of {ROW_TILES}), "
                         f"warpgroups={sched['warpgroups']!r} (one of {WARPGROUPS}), rows={sched['rows']!r} (one "
                         f"of {ROWS}; 64 with one warpgroup)")
    return sched


def ws_runs(sched: dict, layout: str, direct: bool, capturing: bool) -> bool:
    """Whether a launch of the resolved schedule `sched` runs the warp-specialized GEMMs: `ws` asks for them (True,
    or "graphs" while a CUDA graph is `capturing`), and they apply: direct blocks (`direct`: one token, every expert
    held, neither fused nor w2_combine) on "wgmma_steps" weights, one warpgroup, 128 rows."""
    asked = sched["ws"] is True or (sched["ws"] == "graphs" and capturing)
    return asked and direct and layout == "wgmma_steps" and sched["warpgroups"] == 1 and sched["rows"] == 128


def check_schedule(options: dict | None = None) -> None:
    """ValueError unless `options` (over DEFAULT_SCHEDULE) give a runnable schedule for a decode launch and for a
    large one (both `auto_schedule` cases): for settings checked before a run, not at its first MoE layer."""
    for pairs in (1, 10**4):
        resolve_schedule(pairs, **(options or {}))


@functools.cache
def _step_map() -> torch.Tensor:
    """phys [32 words, 8 nibble positions]: the step column held by nibble position of memory word 8 t + j."""
    phys = torch.empty(32, 8, dtype=torch.int64)
    for t in range(4):
        for j in range(8):
            for i in range(4):
                for b in range(2):
                    phys[8 * t + j, i + 4 * b] = 32 * j + 16 * (i >> 1) + 8 * (i & 1) + 2 * t + b
    return phys


def repack_int4_moe_for_wgmma(w13_packed, w13_scale, w2_packed, w2_scale):
    """Checkpoint layout -> "wgmma" layout (module doc); run once at load."""
    return (*permute_steps(w13_packed, w13_scale, _step_map(), STEP),
            *permute_steps(w2_packed, w2_scale, _step_map(), STEP))


def _swap_steps(words: torch.Tensor, scale: torch.Tensor, step_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's words [E, N, Kp/8] and scales [E, N, Kp/32] with each expert's (row, step) order swapped:
    row-major -> step-major (`step_major`) or back; the same shapes, a contiguous copy."""
    E, N, kw = words.shape
    kb = kw * PACK_FACTOR // STEP
    outer = (kb, N) if not step_major else (N, kb)  # the order the tensors are in now
    return tuple(t.reshape(E, *outer, width).transpose(1, 2).reshape(t.shape)
                 for t, width in ((words, 32), (scale, 8)))


def to_step_major(words: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One "wgmma" projection (words [E, N, Kp/8], scales [E, N, Kp/32]) -> "wgmma_steps": the same shapes, each
    expert's steps outermost (module doc); `from_step_major` inverts it."""
    return _swap_steps(words, scale, step_major=True)


def from_step_major(words: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """"wgmma_steps" -> "wgmma" (`to_step_major`'s inverse, bit for bit)."""
    return _swap_steps(words, scale, step_major=False)


def repack_int4_moe_for_wgmma_steps(w13_packed, w13_scale, w2_packed, w2_scale):
    """Checkpoint layout -> "wgmma_steps" layout (module doc), written step-major expert by expert (no "wgmma" copy
    on the way: the load's peak memory as for "wgmma"); run once at load. Equal to `to_step_major` of the "wgmma"
    tensors (CPU test)."""
    return (*permute_steps(w13_packed, w13_scale, _step_map(), STEP, step_major=True),
            *permute_steps(w2_packed, w2_scale, _step_map(), STEP, step_major=True))


def _layout_strides(words: torch.Tensor, scale: torch.Tensor, layout: str) -> tuple[int, ...]:
    """The kernels' strides of one projection in `layout`: (expert, row, step) in words, then (expert, row, step)
    of the scales in 16-byte units; ValueError for tensors not laid out as `layout` says."""
    if layout not in LAYOUTS:
        raise ValueError(f"int4_moe_wgmma: layout {layout!r}, one of {LAYOUTS}")
    if layout == "wgmma":
        if any(scale.stride(i) % 8 for i in (0, 1)) or scale.stride(2) != 1 or words.stride(2) != 1:
            raise ValueError("int4_moe_wgmma: the scales must be rows of 16 bytes and the words rows of int32 "
                             "(repack_int4_moe_for_wgmma's layout)")
        return (words.stride(0), words.stride(1), 32, scale.stride(0) // 8, scale.stride(1) // 8, 1)
    if not (words.is_contiguous() and scale.is_contiguous()):
        raise ValueError("int4_moe_wgmma: the wgmma_steps layout needs contiguous words and scales "
                         "(repack_int4_moe_for_wgmma_steps's tensors or an expert range of them)")
    N = words.shape[1]
    return (words.stride(0), 32, N * 32, scale.stride(0) // 8, 1, N)


def wgmma_layout_dense(words: torch.Tensor, scale: torch.Tensor, in_features: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode one wgmma-layout projection back to dense weights [E, N, K] (q * scale), following the kernel's reading
    of it (word 8 t + j of a step -> its columns, group j): the CPU check of the layout."""
    E, N, kw = words.shape
    steps = kw * PACK_FACTOR // STEP
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=words.device)
    q = (((words.long().view(E, N, steps, 32, 1) >> shifts) & 0xF) - 8).to(torch.float32)
    group = (torch.arange(32, device=words.device) % 8) + 8 * torch.arange(steps, device=words.device).view(steps, 1)
    s = scale.to(torch.float32)[:, :, group]  # [E, N, step, word]
    vals = (q * s.unsqueeze(-1)).to(dtype).view(E, N, steps, STEP)
    dense = torch.empty_like(vals)
    dense[..., _step_map().to(words.device).view(-1)] = vals
    return dense.view(E, N, steps * STEP)[..., :in_features]


def wgmma_dense_experts(w13, s13, w2, s2, hidden: int, dtype: torch.dtype = torch.float32):
    """Both projections of a wgmma-layout expert stack, dense (w13 [E, 2I, D], w2 [E, D, I]): the CPU path."""
    return wgmma_layout_dense(w13, s13, hidden, dtype), wgmma_layout_dense(w2, s2, w13.shape[1] // 2, dtype)


def wgmma_steps_dense_experts(w13, s13, w2, s2, hidden: int, dtype: torch.dtype = torch.float32):
    """`wgmma_dense_experts` of a "wgmma_steps" expert stack."""
    return wgmma_dense_experts(*from_step_major(w13, s13), *from_step_major(w2, s2), hidden, dtype)


def int4_moe_wgmma(x, topk_ids, topk_w, w13, s13, w2, s2, out=None, *, block_pairs: int | None = None,
                   small_pairs: int | None = None, stages: int | None = None, maxnreg: int | None = None,
                   pdl: bool | None = None, direct: bool | None = None, row_tiles: int | None = None,
                   warpgroups: int | None = None, fused: bool | None = None, rows: int | None = None,
                   w2_combine: bool | None = None, ws: bool | str | None = None, ws_stages: int | None = None,
                   ws_row_tiles: int | None = None, experts: range | None = None, reduce_pairs=None,
                   layout: str = "wgmma"):
    """The wgmma path (sm_90, bf16, weights in `layout`: one of LAYOUTS, module doc); arguments as
    `kernels.int4_moe.int4_moe`. The schedule options, each None for DEFAULT_SCHEDULE's, `auto_schedule`'s or
    PLAIN's (`resolve_schedule`):
    `block_pairs` (BLOCK_PAIRS), the pairs per expert block (an expert's weights are streamed once per block);
    `small_pairs` (0 or a smaller BLOCK_PAIRS size), blocks holding at most that many pairs run with the MMA's N
    that small; `stages` (STAGES), the ring depth; `maxnreg`, a register cap; `pdl`, programmatic dependent launch
    (ignored with an expert subset or `reduce_pairs`, whose extra launches sit between the GEMMs and the combine);
    `direct`, one token's pairs as blocks without the grouping launch (ignored unless one token with every expert
    held); `row_tiles` (ROW_TILES), w2's row tiles (of `rows` rows) per program, streamed one after the other
    through one ring that runs on across them (fewer, longer programs: at one token w2 has 448 programs of 8 K steps);
    `warpgroups` (WARPGROUPS), 2: 8-warp programs whose two warpgroups take one weight tensor each (the same MMAs per
    row, twice the warps per SM where the grid is small: at one token w13 has 256 programs); `fused`, one token's
    w13, w2 and combine as one persistent launch (`_int4_moe_decode`: 8-pair tiles, `stages` and `row_tiles` as
    given; ignored unless one token with every expert held and one warpgroup); `rows` (ROWS), the weight rows of a
    program, 64: one [64, N] accumulator (w13: 32 gate rows and their 32 up rows; w2: 64 output rows), half the
    registers and shared memory, twice the programs (at one token 512 w13 programs, 4 per SM); `w2_combine`, the
    combine done by w2's last program of each row range (a count per range) instead of its own launch (ignored unless
    direct blocks run, with one warpgroup, not fused, without `reduce_pairs`); `ws` (WS), one token's w13 and w2 as
    the warp-specialized kernels of `_int4_moe_ws` (a producer warp puts each step in flight by TMA; "graphs": only
    inside a CUDA-graph capture; `ws_runs` says where they apply) with `ws_stages` (STAGES) ring slots and
    `ws_row_tiles` (ROW_TILES) of w2's 128-row tiles a program (the ring kernels' `stages` and `row_tiles` apply where
    the ws kernels do not). Same arithmetic, same bits for every schedule."""
    if not HAVE_GLUON:
        raise RuntimeError("int4_moe_wgmma needs Triton with Gluon (3.5 or newer)")
    sched = resolve_schedule(topk_ids.numel(), block_pairs=block_pairs, small_pairs=small_pairs, stages=stages,
                             maxnreg=maxnreg, pdl=pdl, direct=direct, row_tiles=row_tiles, warpgroups=warpgroups,
                             fused=fused, rows=rows, w2_combine=w2_combine, ws=ws, ws_stages=ws_stages,
                             ws_row_tiles=ws_row_tiles)
    block_pairs, small, stages, cap = sched["block_pairs"], sched["small_pairs"], sched["stages"], sched["maxnreg"]
    pdl = bool(sched["pdl"]) and experts is None and reduce_pairs is None
    direct = bool(sched["direct"]) and x.shape[0] == 1 and experts is None
    if not x.is_cuda or x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] != 9:
        raise ValueError(f"int4_moe_wgmma: bf16 activations on an sm_90 GPU, got {x.dtype} on {x.device}")
    inter, D = w13.shape[1] // 2, x.shape[1]
    st13, st2 = _layout_strides(w13, s13, layout), _layout_strides(w2, s2, layout)
    wg = sched["warpgroups"]
    opts = {"num_warps": 4 * wg, **({"maxnreg": cap} if cap else {}), **({"launch_pdl": True} if pdl else {})}
    R = sched["rows"]
    const = dict(NP=block_pairs, SMALL=small or 0, STAGES=stages, PDL=pdl, DIRECT=direct, WG=wg, ROWS=R, **opts)

    def w13_gemm(x, a, pairs, bexp, topk, P):
        if ws_on:
            _moe_ws_kernel[(-(-inter // 64), P)](a, bexp, P, inter, w13.shape[2] * PACK_FACTOR // STEP, w13.shape[1],
                                                 a.stride(0), *ws_descriptors(w13, s13, x), TOPK=topk, GATED=True,
                                                 ROW_TILES=1, **ws_const)
            return
        _moe_w13_wgmma_kernel[(-(-inter // (R // 2)), bexp.shape[0])](
            x, w13, s13, a, pairs, bexp, P, inter, w13.shape[2] * PACK_FACTOR // STEP, x.stride(0), *st13, a.stride(0),
            TOPK=topk, **const)

    fuse = sched["fused"] and x.shape[0] == 1 and experts is None and reduce_pairs is None and wg == 1
    combine = sched["w2_combine"] and direct and not fuse and reduce_pairs is None and wg == 1
    ws_on = ws_runs(sched, layout, direct and not fuse and not combine, torch.cuda.is_current_stream_capturing())
    ws_const = dict(STAGES=sched["ws_stages"], PDL=pdl, num_warps=4, maxnreg=WS_MAXNREG,
                    **({"launch_pdl": True} if pdl else {}))
    if combine:
        ranges = -(-D // (R * sched["row_tiles"]))
        if ranges > SYNC_WORDS:
            raise ValueError(f"int4_moe_wgmma: w2_combine counts in {SYNC_WORDS} words; {ranges} row ranges need more "
                             "(use more row_tiles or w2_combine=False)")
        counts = _sync_words(x.device, "w2_combine")
        out = torch.empty_like(x) if out is None else out
        tw1 = topk_w.reshape(-1).contiguous()

    def w2_gemm(a, y, pairs, bexp, topk, P):
        rt = sched["ws_row_tiles" if ws_on else "row_tiles"]
        if ws_on:
            _moe_ws_kernel[(-(-D // (128 * rt)), P)](y, bexp, P, D, w2.shape[2] * PACK_FACTOR // STEP, D, y.stride(0),
                                                     *ws_descriptors(w2, s2, a), TOPK=topk, GATED=False, ROW_TILES=rt,
                                                     **ws_const)
            return
        args = (a, w2, s2, y, pairs, bexp, P, D, w2.shape[2] * PACK_FACTOR // STEP, a.stride(0), *st2, y.stride(0))
        grid = (-(-D // (R * rt)), bexp.shape[0])
        if combine:
            _moe_w2_combine_wgmma_kernel[grid](*args, tw1, out, counts, TOPK=topk, ROW_TILES=rt,
                                               **{k: v for k, v in const.items() if k not in ("DIRECT", "WG")})
        else:
            _moe_w2_wgmma_kernel[grid](*args, TOPK=topk, ROW_TILES=rt, **const)

    def decode(x, a, y, out, ids, tw):
        rt, sync = sched["row_tiles"], _sync_words(x.device, "fused")
        ranges = -(-D // (R * rt))
        if 2 + ids.numel() + ranges > SYNC_WORDS:
            raise ValueError(f"int4_moe_wgmma: the fused decode counts in {SYNC_WORDS} words; top-{ids.numel()} with "
                             f"{ranges} row ranges needs more (use more row_tiles or fused=False)")
        items = ids.numel() * (-(-inter // (R // 2)) + ranges)
        # at least as many as fit at once (2-4 per SM by the ring and rows; the others start when tickets ran out)
        grid = min(items, 4 * torch.cuda.get_device_properties(x.device).multi_processor_count)
        _moe_decode_kernel[(grid,)](
            x, w13, s13, w2, s2, a, y, out, ids, tw, sync, inter, D, w13.shape[2] * PACK_FACTOR // STEP,
            w2.shape[2] * PACK_FACTOR // STEP, x.stride(0), a.stride(0), y.stride(0), *st13, *st2,
            TOPK=ids.numel(), STAGES=stages, ROW_TILES=rt, R=R, num_warps=4,
            **({"maxnreg": cap or DECODE_MAXNREG[R]} if cap or DECODE_MAXNREG[R] else {}))

    return routed_moe("int4_moe_wgmma", x, topk_ids, topk_w, w13, s13, w2, s2, out, k_align=STEP,
                      block_pairs=block_pairs, experts=experts, reduce_pairs=reduce_pairs, w13_gemm=w13_gemm,
                      w2_gemm=w2_gemm, pdl=pdl, direct=direct and not fuse, fused=decode if fuse else None,
                      combined=combine)


_SYNC: dict[tuple[torch.device, str], torch.Tensor] = {}


def _sync_words(device: torch.device, use: str) -> torch.Tensor:
    """The counters of `use` ("fused": the fused decode kernel's; "w2_combine": w2's row-range counts) on `device`,
    zero between launches (each launch zeroes what it counted): made at the first call, which must not be inside a
    CUDA graph capture. Launches on one device must be stream ordered (the verifier's one stream; a CUDA graph
    captures the buffer and replays in order)."""
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if (device, use) not in _SYNC:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"int4_moe_wgmma: run a one-token launch with {use}=True once outside a CUDA graph "
                               "capture first (its counters are made there)")
        _SYNC[device, use] = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=device)
    return _SYNC[device, use]
