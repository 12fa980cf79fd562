"""Warp-specialized Gluon (sm_90) GEMMs of `kernels.int4_moe_wgmma`'s one-token decode (schedule option `ws`,
auto_schedule's choice inside a CUDA-graph capture; step-major weights, "wgmma_steps", only).

The ring kernels (`_int4_moe_wgmma._ring_gemm`) make every warp issue its share of a step's copies, wait for its own
cp.async groups and meet the others at two CTA barriers a step. The thirty-fourth session's stall samples put 26-29%
of the one-token kernels' time there and 9-15% in the copy issue. Here the roles are split:

  producer   one warp: for each K step, waits until the consumers released the step's ring slot (`empty`), then
             puts the step in flight by TMA onto the slot's `full` mbarrier: tensor a's and b's [64, 32] words and
             [64, 8] scales (boxes of the step-major views: a step of an expert is N rows of them) and the pair's
             4 x 64 activations (an [8, 64] box each from the pair's row into rows 8 c .. 8 c + 7 of the slot: the
             8-pair MMA reads its slot 0 from row 8 c; the next 7 rows of the tensor, or zeros past its end, fill
             the other slots, whose output columns are not stored). A box cannot be one row of the slot's swizzled
             layout. Under PDL, w2's producer puts its first STAGES steps' weights in flight before it waits for
             w13 (as the ring kernels do).
  consumer   one warpgroup: waits for `full`, reads the slot's words and scales, dequantises and runs the same MMAs
             in the same order as the ring kernels (`_step_mmas`, N = 8), then releases the slot; at the end the
             same store (`_store_rows`).

So a step costs the consumers one mbarrier wait and the release (a warpgroup barrier, then one arrival), and the
copies of STAGES steps run ahead of them. The arithmetic and its order are the ring kernels' direct decode path's:
the same bits (GPU test). A TMA load issued from a kernel that is not warp-specialized gets a CTA barrier of its own
from the compiler (docs/performance.md, thirty-fifth session); in the producer's one-warp partition it does not
stall the consumers.

Programs: w13 (GATED): 64 gate rows and their 64 up rows of one pair's expert; w2: ROW_TILES tiles of 128 output
rows, one after the other through the ring (the producer runs on into the next tile's steps while the consumers
finish one). Grid (row tiles, pairs), one pair per program (direct blocks: `bexp` holds the pairs' expert ids).
"""

from __future__ import annotations

import torch

WS_MAXNREG = 128  # registers a thread at launch: 2 programs of 8 warps (4 consumer, 1 producer, 3 idle) per SM
PRODUCER_REGS = 40  # setmaxnreg of the producer warp's warpgroup (the consumers get the rest: 216)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from kernels._gluon_compat import tma_load
    from kernels._int4_moe_wgmma import (
        _W_L1,
        HAVE_GLUON,
        _block_expert,
        _gdc_launch_dependents,
        _gdc_wait,
        _scales_from,
        _step_mmas,
        _store_rows,
        _words_from,
    )
    # the ring slots' shared layouts, which the descriptors' boxes must have: the words' is the ring kernels' XOR
    # pattern as the 128-byte TMA swizzle, the scales' plain rows, the activations' [32, 64] bf16 (4 chunks x 8 pair
    # slots: the 8-pair MMA's B operand) the wgmma default
    _W_WS_LAYOUT = gl.NVMMASharedLayout(128, 32)
    _S_WS_LAYOUT = gl.NVMMASharedLayout(0, 16)
    _X_WS_LAYOUT = gl.NVMMASharedLayout(128, 16)
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False


def ws_descriptors(words: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> tuple:
    """TMA descriptors of one projection's step-major words and scales (`_moe_ws_kernel`: [64, .] boxes of the
    [E * steps * N, 32 | 8] views) and of its activations x [rows, Kp] ([8, 64] boxes: rows past x's end arrive as
    zeros)."""
    rows = words.numel() // 32
    return (TensorDescriptor(words.view(rows, 32), [rows, 32], [32, 1], [64, 32], _W_WS_LAYOUT),
            TensorDescriptor(scale.view(rows, 8), [rows, 8], [8, 1], [64, 8], _S_WS_LAYOUT),
            TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [8, 64], _X_WS_LAYOUT))


if HAVE_GLUON:
    _W_WS_SL = gl.constexpr(_W_WS_LAYOUT)
    _S_WS_SL = gl.constexpr(_S_WS_LAYOUT)
    _X_WS_SL = gl.constexpr(_X_WS_LAYOUT)
    _REGS = gl.constexpr([PRODUCER_REGS])

    @gluon.jit
    def _load_w(wdesc, sdesc, bar, w_dst, s_dst, ra, rb, live):
        """One step's weights: tensor a's and b's words and scales (boxes of B rows at view rows ra, rb)."""
        B: gl.constexpr = wdesc.block_type.shape[0]
        tma_load(wdesc, [ra, 0], bar, w_dst.slice(0, B), pred=live)
        tma_load(wdesc, [rb, 0], bar, w_dst.slice(B, B), pred=live)
        tma_load(sdesc, [ra, 0], bar, s_dst.slice(0, B), pred=live)
        tma_load(sdesc, [rb, 0], bar, s_dst.slice(B, B), pred=live)

    @gluon.jit
    def _load_x(xdesc, bar, x_dst, x_row, f, live):
        """Step f's 4 chunks of 64 activations, each an [8, 64] box from x_row into rows 8 c .. 8 c + 7 (row 8 c is
        the pair's: the 8-pair MMA's slot 0)."""
        for c in gl.static_range(4):
            tma_load(xdesc, [x_row, f * 256 + c * 64], bar, x_dst.slice(8 * c, 8), pred=live)

    @gluon.jit
    def _step_row(row, f, num_kb, rows_step, ROW_TILES: gl.constexpr):
        """The view row of ring step f's box at `row` (tile 0, step 0): row tile f // num_kb (128 rows on), its K
        step f % num_kb (rows_step rows on); one row tile: step f."""
        if ROW_TILES == 1:
            return row + f * rows_step
        else:
            return row + (f // num_kb) * 128 + (f % num_kb) * rows_step

    @gluon.jit
    def _ws_producer(wdesc, sdesc, xdesc, xring, wring, sring, full, empty, row_a, row_b, x_row, num_kb, n_tiles,
                     rows_step, STAGES: gl.constexpr, WPRE: gl.constexpr, ROW_TILES: gl.constexpr):
        """Ring step f is row tile f // num_kb's K step f % num_kb (n_tiles row tiles, one after the other through
        the ring). WPRE (w2 under PDL): the first STAGES steps' weights go in flight before the wait for the previous
        grid (w13, whose `a` the activations are), then their activations."""
        nbytes: gl.constexpr = 2 * (wdesc.block_type.nbytes + sdesc.block_type.nbytes) + 4 * xdesc.block_type.nbytes
        total = n_tiles * num_kb
        first = 0
        if WPRE:
            for p in gl.static_range(STAGES):
                mbarrier.expect(full.index(p), nbytes, pred=p < total)
                _load_w(wdesc, sdesc, full.index(p), wring.index(p), sring.index(p),
                        _step_row(row_a, p, num_kb, rows_step, ROW_TILES),
                        _step_row(row_b, p, num_kb, rows_step, ROW_TILES), p < total)
            _gdc_launch_dependents()  # the combine may be scheduled; it waits for this grid's end
            _gdc_wait()
            for p in gl.static_range(STAGES):
                _load_x(xdesc, full.index(p), xring.index(p), x_row, p if ROW_TILES == 1 else p % num_kb, p < total)
            first = STAGES
        for f in range(first, total):
            st = f % STAGES
            # slot st is free once the consumers released step f - STAGES (phase f // STAGES - 1 of `empty`)
            mbarrier.wait(empty.index(st), (f // STAGES + 1) & 1, pred=f >= STAGES)
            bar = full.index(st)
            mbarrier.expect(bar, nbytes)
            ra = _step_row(row_a, f, num_kb, rows_step, ROW_TILES)
            rb = _step_row(row_b, f, num_kb, rows_step, ROW_TILES)
            _load_w(wdesc, sdesc, bar, wring.index(st), sring.index(st), ra, rb, True)
            _load_x(xdesc, bar, xring.index(st), x_row, f if ROW_TILES == 1 else f % num_kb, True)

    @gluon.jit
    def _ws_consumer(xring, wring, sring, full, empty, out_ptr, blk, row0, P, N_OUT, num_kb, n_tiles, stride_o,
                     GATED: gl.constexpr, STAGES: gl.constexpr, WPRE: gl.constexpr):
        """Row tile t's rows from row0 + 128 t, stored after its last K step. WPRE: waits for the previous grid
        before anything else (its stores come after that grid's end)."""
        if WPRE:
            _gdc_wait()
        ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
        A_L: gl.constexpr = gl.DotOperandLayout(0, ACC_L, 2)
        for t in range(n_tiles):
            acc_a = gl.zeros([64, 8], gl.float32, ACC_L)
            acc_b = gl.zeros([64, 8], gl.float32, ACC_L)
            for kb in range(num_kb):
                f = t * num_kb + kb
                st = f % STAGES
                mbarrier.wait(full.index(st), (f // STAGES) & 1)  # TMA wrote it (async proxy): no fence for wgmma
                ws = wring.index(st)
                ss = sring.index(st)
                qa = _words_from(ws.slice(0, 64), _W_L1)
                qb = _words_from(ws.slice(64, 64), _W_L1)
                sca = _scales_from(ss.slice(0, 64), _W_L1)
                scb = _scales_from(ss.slice(64, 64), _W_L1)
                acc_a, acc_b = _step_mmas(qa, sca, qb, scb, xring.index(st), acc_a, acc_b, 8, A_L)  # waits its MMAs
                mbarrier.arrive(empty.index(st), count=1)  # lowered as: warpgroup barrier, then one lane arrives
            _store_rows(acc_a, acc_b, out_ptr, out_ptr, blk, row0 + t * 128, P, N_OUT, stride_o, GATED, 8, 8, True,
                        ACC_L, 1, 128)

    @gluon.jit
    def _moe_ws_kernel(out_ptr, bexp_ptr, P, N_OUT, num_kb, rows_step, stride_o, wdesc, sdesc, xdesc,
                       TOPK: gl.constexpr, GATED: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
                       ROW_TILES: gl.constexpr):
        """One pair's row tile of w13 (GATED: a[pair, 64 columns] = SiLU(gate) * up) or w2 (y[pair, 128 rows], fp32,
        unweighted). wdesc / sdesc: the step-major words [E * steps * N, 32] and scales [E * steps * N, 8] in
        [64, .] boxes (rows_step = N, the projection's rows); xdesc: the activations (w13: x [1, Kp]; w2: a [P, Kp])
        in [8, 64] boxes. PDL (programmatic dependent launch, as the ring kernels): w13 waits for the previous grid
        before anything is read, then lets w2 be scheduled; w2 reads its pair's expert (past L1: w13 passed its wait,
        so the routing is complete), puts its first weight steps in flight and only then waits (`_ws_producer`).
        ROW_TILES (w2 only): a program's row tiles of 128 rows, one after the other through one ring (those past
        N_OUT skipped)."""
        gl.static_assert(gl.num_warps() == 4)
        gl.static_assert(ROW_TILES == 1 or not GATED)
        WPRE: gl.constexpr = PDL and not GATED
        pid_r = gl.program_id(0)
        blk = gl.program_id(1)
        e = _block_expert(bexp_ptr, blk, PDL, GATED)
        if e < 0:
            return
        if GATED:
            row0 = pid_r * 64
            row_a = e * (num_kb * rows_step) + row0
            row_b = row_a + N_OUT  # the up rows of the same intermediate columns
            x_row = blk // TOPK  # the pair's token
        else:
            row0 = pid_r * (ROW_TILES * 128)
            row_a = e * (num_kb * rows_step) + row0
            row_b = row_a + 64
            x_row = blk  # the pair's row of `a`
        if ROW_TILES == 1:
            n_tiles = 1
        else:
            n_tiles = gl.minimum(gl.cdiv(N_OUT - row0, 128), ROW_TILES)
        xring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 32, 64], _X_WS_SL)
        wring = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 32], _W_WS_SL)
        sring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 128, 8], _S_WS_SL)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)  # the producer's expect; the bytes complete it
            mbarrier.init(empty.index(i), count=1)  # the consumer warpgroup's release
        fence_async_shared()  # the inits, seen by the TMA unit's arrivals (the partitions start behind a CTA barrier)
        gl.warp_specialize([
            (_ws_consumer, (xring, wring, sring, full, empty, out_ptr, blk, row0, P, N_OUT, num_kb, n_tiles,
                            stride_o, GATED, STAGES, WPRE)),
            (_ws_producer, (wdesc, sdesc, xdesc, xring, wring, sring, full, empty, row_a, row_b, x_row, num_kb,
                            n_tiles, rows_step, STAGES, WPRE, ROW_TILES)),
        ], [1], _REGS)
