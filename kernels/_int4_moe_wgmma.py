"""Gluon (sm_90 wgmma) kernels of `kernels.int4_moe`: dequantised weights as the register A operand, the block's
activations as the shared-memory B operand.

  acc [64 rows, N pairs]  +=  W [64 rows, 64 K] (registers)  x  X [64 K, N pairs] (shared memory)

per 64-column chunk, with `warpgroup_mma` (m64nNk16: N = the expert block's pairs, 8 to 64). No warp holds the
activations in registers or reads them through L1: the mma.sync kernels (`_int4_moe_gluon`, `_int4_moe_kernels`) load
the whole activation operand into every warp, which bounds them by the L1 / shared-memory pipe when a verify step's
tree tokens crowd their experts (twelfth session's ncu: `docs/performance.md`).

A program is one warpgroup (4 warps) and two 64-row weight tensors that share the activations: w13 its 64 gate
rows and the 64 up rows of the same intermediate columns (SiLU(gate) * up fused into the store), w2 128 output rows.
Each 256-column K step of the block's activations, of both tensors' words and of their scales is copied by 16-byte
cp.async into a STAGES-slot shared-memory ring (STAGES - 1 steps in flight, one CTA barrier per step); the words
are read back with 16-byte loads (XOR-swizzled: no bank conflicts) and dequantised in registers (Marlin's lop3 trick,
bf16(q * s) rounded once, as the other paths). With SMALL > 0, a block of NP slots that holds at most SMALL pairs
runs the same loop with N = SMALL (fewer MMA columns and activation copies; the block list is built for NP).

Weight layout ("wgmma", `kernels.int4_moe_wgmma`): K in natural order (the B operand is the activations as they
are), each 256-column step of a row is 32 words, memory word 8 t + j (t = lane % 4, j = quantisation group of the
step) holds the 8 columns 32 j + 16 i1 + 8 i0 + 2 t + b (nibble position i + 4 b with i = i0 + 2 i1): exactly what
lane t needs of that row for the wgmma A fragments of k16 blocks 2j and 2j + 1, and one group (one scale) per word.

Batch invariance: an output column (a pair) is computed from its own activation row and the weights only, in a
fixed K order (chunks of 64, k16 blocks in order, fp32 accumulation): its bits do not depend on the block's other
pairs, on which block slot it has, or on the launch.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from kernels._gluon_compat import cp_async, cta_barrier
    from kernels._int4_moe_gluon import _DEQUANT_PAIR_PTX

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

if HAVE_GLUON:
    _DEQUANT = gl.constexpr(_DEQUANT_PAIR_PTX)
    # one warpgroup's [64 rows, 4 t, 8 j] words: j in registers (8 contiguous words), t on lanes 0-1, rows as the A
    # fragment's; its ring slots' scales [128 rows, 8] as copied; words and scales in shared memory (a lane's 8 words
    # conflict-free: 16-byte vectors XOR-swizzled by row % 8)
    _W_L1 = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 4, 8]))
    _CS_L1 = gl.constexpr(gl.BlockedLayout([1, 8], [32, 1], [4, 1], [1, 0]))
    _CS_L64 = gl.constexpr(gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0]))  # 64-row slots: 8-byte copies
    _W_SL = gl.constexpr(gl.SwizzledSharedLayout(4, 1, 8, [1, 0]))
    _S_SL = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    @gluon.jit
    def _chunk(v, c: gl.constexpr):
        """[R, 4 t, 8 j] -> chunk c's words (j = 2c, 2c + 1): [R, 4 t, 2 jl] (register-only splits)."""
        v = gl.permute(gl.reshape(v, [v.shape[0], 4, 2, 2, 2]), (0, 1, 4, 2, 3))  # (row, t, jl, c1, c0)
        e, o = gl.split(v)  # c0 = 0 / 1
        if c % 2 == 0:
            h = e
        else:
            h = o
        lo, hi = gl.split(h)  # c1 = 0 / 1
        if c // 2 == 0:
            return lo
        return hi

    @gluon.jit
    def _expand(v):
        """[64, 4, 2] -> [64, 4, 2, 2 i0, 2 i1, 2 b]: word >> 4 i (i = i0 + 2 i1), twice (b: the asm's pair)."""
        u = gl.join(gl.join(v, v >> 4), gl.join(v >> 8, v >> 12))
        return gl.join(u, u)

    @gluon.jit
    def _expand_same(v):
        u = gl.join(gl.join(v, v), gl.join(v, v))
        return gl.join(u, u)

    @gluon.jit
    def _a_operand(words, scales, c: gl.constexpr, A_L: gl.constexpr):
        """Chunk c of a step (64 columns) dequantised: [R rows, 64 K] bf16 in the wgmma A layout."""
        wx = _expand(_chunk(words, c))
        sx = gl.convert_layout(_expand_same(_chunk(scales, c)), wx.type.layout, assert_trivial=True)
        deq = gl.inline_asm_elementwise(_DEQUANT, "=r,r,r,r", [wx, sx], dtype=gl.bfloat16, is_pure=True, pack=2)
        # (row, t, jl, i0, i1, b) -> column 32 jl + 16 i1 + 8 i0 + 2 t + b
        deq = gl.reshape(gl.permute(deq, (0, 2, 4, 3, 1, 5)), [words.shape[0], 64])
        return gl.convert_layout(deq, A_L)

    @gluon.jit
    def _copy_x(x_rows, kb, live, dst, XC_L: gl.constexpr):
        """Step kb of the block's activations into `dst` [4 chunks x NP pairs, 64 columns]: row c NP + n holds
        columns 64 c .. 64 c + 63 of the step for pair slot n (one 16-byte cp.async per 8 columns)."""
        NP: gl.constexpr = x_rows.shape[0] // 4
        i = gl.arange(0, 4 * NP, layout=gl.SliceLayout(1, XC_L))
        col = gl.arange(0, 64, layout=gl.SliceLayout(0, XC_L))
        base = gl.expand_dims(x_rows + kb * 256 + (i // NP) * 64, 1) + gl.expand_dims(col, 0)
        cp_async(dst, base, mask=(gl.expand_dims(col, 0) < 64) & live)

    @gluon.jit
    def _copy_w(w_src, w_ok, s_src, s_ok, kb, live, w_dst, s_dst, stride_wk, stride_sk8):
        """Step kb of both weight tensors' words [128 rows, 32] and scales [128 rows, 8] into one ring slot (rows
        0-63: tensor a, 64-127: tensor b; rows past the projection and steps past the end are zero-filled). A row's
        steps are stride_wk words and stride_sk8 16-byte scale units apart (32 and 1 in the row-major layout, N * 32
        and N in the step-major one)."""
        cp_async(w_dst, w_src + kb * stride_wk, mask=w_ok & live)
        cp_async(s_dst, s_src + kb * (stride_sk8 * 8), mask=s_ok & live)

    @gluon.jit
    def _copy_stage(x_rows, w_src, w_ok, s_src, s_ok, kb, live, x_dst, w_dst, s_dst, stride_wk, stride_sk8,
                    XC_L: gl.constexpr):
        """Step kb of the block's activations and of both weight tensors into one ring slot."""
        _copy_x(x_rows, kb, live, x_dst, XC_L)
        _copy_w(w_src, w_ok, s_src, s_ok, kb, live, w_dst, s_dst, stride_wk, stride_sk8)

    @gluon.jit
    def _gdc_wait():
        """Programmatic dependent launch: wait until the previous grid has finished and its writes are visible
        (a no-op when the kernel was not launched with PDL)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _gdc_launch_dependents():
        """Programmatic dependent launch: the next grid may be scheduled once every CTA of this one has said so
        (or exited); it still waits for this grid's end before it reads what this grid writes."""
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _block_expert(bexp_ptr, blk, PDL: gl.constexpr, GATED: gl.constexpr):
        """Block blk's expert (int32; < 0: no block), read under programmatic dependent launch (PDL) as follows: w13
        waits before it reads anything (the block list is the align kernel's), then lets w2 be scheduled; w2, which
        starts while w13 still runs, reads it past L1 (w13 passed its wait, so the block list is complete); it puts
        its first weight steps in flight before it waits for w13's `a` (its caller's part)."""
        if PDL and GATED:
            _gdc_wait()
            _gdc_launch_dependents()
        if PDL and not GATED:
            e = gl.load(bexp_ptr + blk, cache_modifier=".cg").to(gl.int32)
        else:
            e = gl.load(bexp_ptr + blk).to(gl.int32)
        return e

    @gluon.jit
    def _fence_gpu():
        """This thread's writes before it / reads after it ordered at GPU scope (with a CTA barrier and one thread's
        atomic: the CTA's stores published to, or another CTA's stores seen by, every thread of the CTA)."""
        gl.inline_asm_elementwise("fence.acq_rel.gpu; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _publish():
        """Before one thread's release of a counter that announces this CTA's global stores: every thread fences its
        own stores at GPU scope, then a CTA barrier, so that all of them precede the release (the counting thread's
        fence alone covers only its own stores: a scalar atomic is thread 0's, and Triton 3.6 puts no barrier before
        it (3.9 does, triton-lang/triton#10816); without this, a reader could see the count before another warp's
        last stores)."""
        _fence_gpu()
        cta_barrier()

    @gluon.jit
    def _combine_rows(y_ptr, tw_ptr, out_ptr, row0, D, stride_y, TOPK: gl.constexpr, R: gl.constexpr):
        """out[row0 : row0 + R] = sum over slots k = 0..TOPK-1, in that order, of tw[k] * y[k] (fp32; the separate
        combine kernel's arithmetic, so the same bits). y is read past L1 (other CTAs wrote it)."""
        L: gl.constexpr = gl.BlockedLayout([(R + 127) // 128], [32], [4], [0])
        cols = row0 + gl.arange(0, R, layout=L)
        m = cols < D
        acc = gl.zeros([R], gl.float32, L)
        for k in gl.static_range(TOPK):
            wk = gl.load(tw_ptr + k).to(gl.float32)
            acc += wk * gl.load(y_ptr + k * stride_y + cols, mask=m, other=0.0, cache_modifier=".cg")
        gl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=m)

    @gluon.jit
    def _words_from(smem, W_L: gl.constexpr):
        """[R rows, 32 words] of a ring slot (R = 64: one warpgroup's tensor; 128: both tensors over two warpgroups)
        -> [R, 4 t, 8 j] in W_L (a lane reads its 8 contiguous words)."""
        R: gl.constexpr = smem.shape[0]
        if R == 64:
            W2_L: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]], lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32])
        else:
            W2_L: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]], lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                warp_bases=[[16, 0], [32, 0], [64, 0]], block_bases=[], shape=[128, 32])
        return gl.convert_layout(gl.reshape(smem.load(W2_L), [R, 4, 8]), W_L, assert_trivial=True)

    @gluon.jit
    def _scales_from(smem, W_L: gl.constexpr):
        """[R rows, 8 groups] of a ring slot -> [R, 4 t, 8 j] in W_L (the 4 lanes of a row read the same 16 bytes)."""
        v = gl.expand_dims(smem.load(gl.SliceLayout(1, W_L)), 1)
        return v.broadcast_to([smem.shape[0], 4, 8])

    @gluon.jit
    def _step_mmas2(q, sc, xs, acc, NP: gl.constexpr, A_L: gl.constexpr):
        """WG = 2: one 256-column step of both tensors stacked along M ([128 rows]: each warpgroup's m64nNPk16 MMAs on
        its own 64 rows, in the order WG = 1 runs them for that tensor); chunk c's MMAs run while chunk c + 1 is
        dequantised, and the step waits for them once at its end: with 8 warps Gluon puts a CTA barrier after every
        wait (4 a step when waiting per chunk, as WG = 1 does; one this way, for 105-127 registers, not 78-103)."""
        a0 = _a_operand(q, sc, 0, A_L)
        acc = warpgroup_mma(a0, xs.slice(0 * NP, NP).permute((1, 0)), acc, is_async=True)
        a1 = _a_operand(q, sc, 1, A_L)
        acc = warpgroup_mma(a1, xs.slice(1 * NP, NP).permute((1, 0)), acc, is_async=True)
        a2 = _a_operand(q, sc, 2, A_L)
        acc = warpgroup_mma(a2, xs.slice(2 * NP, NP).permute((1, 0)), acc, is_async=True)
        a3 = _a_operand(q, sc, 3, A_L)
        acc = warpgroup_mma(a3, xs.slice(3 * NP, NP).permute((1, 0)), acc, is_async=True)
        acc, a0, a1, a2, a3 = warpgroup_mma_wait(num_outstanding=0, deps=[acc, a0, a1, a2, a3])
        return acc

    @gluon.jit
    def _step_mmas(qa, sca, qb, scb, xs, acc_a, acc_b, NP: gl.constexpr, A_L: gl.constexpr):
        """One 256-column step: 4 chunks x 2 tensors of m64nNPk16 MMAs; chunk c's MMAs run while chunk c + 1 is
        dequantised."""
        a_a = _a_operand(qa, sca, 0, A_L)
        a_b = _a_operand(qb, scb, 0, A_L)
        for c in gl.static_range(4):
            b_op = xs.slice(c * NP, NP).permute((1, 0))
            acc_a = warpgroup_mma(a_a, b_op, acc_a, is_async=True)
            acc_b = warpgroup_mma(a_b, b_op, acc_b, is_async=True)
            if c < 3:
                n_a = _a_operand(qa, sca, c + 1, A_L)
                n_b = _a_operand(qb, scb, c + 1, A_L)
            acc_a, acc_b, a_a, a_b = warpgroup_mma_wait(num_outstanding=0, deps=[acc_a, acc_b, a_a, a_b])
            if c < 3:
                a_a, a_b = n_a, n_b
        return acc_a, acc_b

    @gluon.jit
    def _ring_step(f, x_rows, nw_src, nw_ok, ns_src, ns_ok, nkb, nlive, xring, wring, sring, acc_a, acc_b,
                   stride_wk, stride_sk8, N: gl.constexpr, STAGES: gl.constexpr, W_L: gl.constexpr, A_L: gl.constexpr,
                   XC_L: gl.constexpr, WG: gl.constexpr):
        """Ring step f: wait for its slot's copies, put the copies of step f + STAGES - 1 in flight (its activation
        step `nkb`, its weight sources `nw_src` / `ns_src` at that step, `nlive` False past the end), then its MMAs.
        One accumulator [R, N] (R = the slot's rows = 64 WG: one tensor of 64 rows, or WG = 2's two over two
        warpgroups): acc_a and acc_b are it (both names, so the loops are the same)."""
        # two CTA barriers a step. The compiler puts one right after the wait (its rule after every cp.async wait):
        # every warp is then done with step f - 1, whose slot the copies below refill. Ours comes after the copies:
        # everyone's copies of step f have landed and are fenced for the MMAs (async proxy). It is also the one the
        # compiler would put before the reads below, since it cannot tell the ring's slots apart (before: a third,
        # right after the fence, which left the copies' issue and the fence's latency on the critical path)
        cp.wait_group(STAGES - 2)  # this thread's copies of step f landed
        fence_async_shared()
        ns = (f + STAGES - 1) % STAGES
        _copy_stage(x_rows, nw_src, nw_ok, ns_src, ns_ok, nkb, nlive, xring.index(ns).slice(0, 4 * N), wring.index(ns),
                    sring.index(ns), stride_wk, stride_sk8, XC_L)
        cp.commit_group()
        cta_barrier()
        slot = f % STAGES
        ws = wring.index(slot)
        ss = sring.index(slot)
        if wring.shape[1] == 64 * WG:
            acc_a = _step_mmas2(_words_from(ws, W_L), _scales_from(ss, W_L), xring.index(slot).slice(0, 4 * N), acc_a,
                                N, A_L)
            acc_b = acc_a
        else:
            qa = _words_from(ws.slice(0, 64), W_L)
            qb = _words_from(ws.slice(64, 64), W_L)
            sca = _scales_from(ss.slice(0, 64), W_L)
            scb = _scales_from(ss.slice(64, 64), W_L)
            acc_a, acc_b = _step_mmas(qa, sca, qb, scb, xring.index(slot).slice(0, 4 * N), acc_a, acc_b, N, A_L)
        return acc_a, acc_b

    @gluon.jit
    def _tile_src(w_src, s_src, gw, gs, N_OUT, stride_wn, stride_sn8, t, CW_L: gl.constexpr, CS_L: gl.constexpr):
        """Row tile t (of a program's ROW_TILES, R rows each after tile 0's; R = gw's length) of w2: its word and
        scale sources (tile 0's moved by t * R rows) and masks (rows past the projection are zero-filled)."""
        R: gl.constexpr = gw.shape[0]
        okw = gl.expand_dims(gw + t * R < N_OUT, 1) & gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, CW_L))
                                                                       < 32, 0)
        oks = gl.expand_dims(gs + t * R < N_OUT, 1) & gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, CS_L))
                                                                       < 8, 0)
        return w_src + t * R * stride_wn, okw, s_src + t * (R * 8) * stride_sn8, oks

    @gluon.jit
    def _weight_src(w_ptr, s_ptr, e, pid_r, N_OUT, stride_we, stride_wn, stride_se8, stride_sn8, GATED: gl.constexpr,
                    ROW_TILES: gl.constexpr, CW_L: gl.constexpr, CS_L: gl.constexpr, R: gl.constexpr = 128):
        """Expert e's ring-slot sources of row tile pid_r: words [R rows, 32] and scales [R rows, 8] at step 0,
        their masks, and the unmasked rows (gw, gs) that `_tile_src` moves. w13: the slot's first R / 2 rows are gate
        rows, the rest the up rows of the same intermediate columns; w2: R output rows, the program's first of
        ROW_TILES tiles. R = 128: rows 0-63 are tensor a, 64-127 tensor b. Rows past the projection are zero-filled."""
        H: gl.constexpr = R // 2
        rw = gl.arange(0, R, layout=gl.SliceLayout(1, CW_L))
        rs = gl.arange(0, R, layout=gl.SliceLayout(1, CS_L))
        if GATED:
            row0 = pid_r * H
            gw = row0 + rw % H + (rw // H) * N_OUT
            okw = row0 + rw % H < N_OUT
            gs = row0 + rs % H + (rs // H) * N_OUT
            oks = row0 + rs % H < N_OUT
        else:
            row0 = pid_r * (ROW_TILES * R)  # the program's first row tile
            gw = row0 + rw
            okw = gw < N_OUT
            gs = row0 + rs
            oks = gs < N_OUT
        cw = gl.arange(0, 32, layout=gl.SliceLayout(0, CW_L))
        cs = gl.arange(0, 8, layout=gl.SliceLayout(0, CS_L))
        w_base = w_ptr + e.to(gl.int64) * stride_we
        s_base = s_ptr + e.to(gl.int64) * (stride_se8 * 8)
        w_src = gl.expand_dims(w_base + gw * stride_wn, 1) + gl.expand_dims(cw, 0)
        s_src = gl.expand_dims(s_base + gs * (stride_sn8 * 8), 1) + gl.expand_dims(cs, 0)
        w_ok = gl.expand_dims(okw, 1) & gl.expand_dims(cw < 32, 0)  # full-shape masks
        s_ok = gl.expand_dims(oks, 1) & gl.expand_dims(cs < 8, 0)
        return w_src, w_ok, s_src, s_ok, gw, gs

    @gluon.jit
    def _prefetch_w(w_src, w_ok, s_src, s_ok, gw, gs, N_OUT, num_kb, stride_wn, stride_sn8, stride_wk, stride_sk8,
                    wring, sring, STAGES: gl.constexpr, ROW_TILES: gl.constexpr, CW_L: gl.constexpr,
                    CS_L: gl.constexpr):
        """The weights of the ring's first STAGES - 1 steps in flight, one commit group each (`_ring_gemm`'s WPRE:
        its activation copies follow as groups of their own)."""
        for st in gl.static_range(STAGES - 1):
            if ROW_TILES == 1:
                _copy_w(w_src, w_ok, s_src, s_ok, st, st < num_kb, wring.index(st), sring.index(st), stride_wk,
                        stride_sk8)
            else:  # ring step st of the program's tiles (tile st // num_kb)
                sw, okw, ss, oks = _tile_src(w_src, s_src, gw, gs, N_OUT, stride_wn, stride_sn8,
                                             gl.minimum(st // num_kb, ROW_TILES - 1), CW_L, CS_L)
                _copy_w(sw, okw, ss, oks, st % num_kb, st < ROW_TILES * num_kb, wring.index(st), sring.index(st),
                        stride_wk, stride_sk8)
            cp.commit_group()

    @gluon.jit
    def _pair_ids(pairs_ptr, blk, P, N: gl.constexpr, NP: gl.constexpr, DIRECT: gl.constexpr, L: gl.constexpr):
        """The block's first N pair ids along dim 1 of layout L (P: an empty slot; DIRECT: pair `blk` in slot 0)."""
        slot = gl.arange(0, N, layout=gl.SliceLayout(0, L))
        if DIRECT:
            pairs = gl.where(slot == 0, blk, P)
        else:
            pairs = gl.load(pairs_ptr + blk * NP + slot)
        return pairs

    @gluon.jit
    def _store_cols(out_ptr, pairs, orow, vals, P, N_OUT, stride_o):
        """out[pair, row] = vals [rows, pairs] for the live pairs and the rows inside the projection."""
        gl.store(out_ptr + gl.expand_dims(pairs.to(gl.int64) * stride_o, 0) + gl.expand_dims(orow, 1), vals,
                 mask=gl.expand_dims(pairs < P, 0) & gl.expand_dims(orow < N_OUT, 1))

    @gluon.jit
    def _store_rows(acc_a, acc_b, out_ptr, pairs_ptr, blk, row0, P, N_OUT, stride_o, GATED: gl.constexpr,
                    N: gl.constexpr, NP: gl.constexpr, DIRECT: gl.constexpr, ACC_L: gl.constexpr, WG: gl.constexpr,
                    R: gl.constexpr = 128):
        """The block's N pair columns of rows row0..: w13 SiLU(gate) * up (R / 2 rows), w2 R rows. R = 128 with one
        warpgroup: two accumulators (tensors a, b) [64, N]; otherwise one, acc_a [R, N] (R = 64 WG), through which
        w13 goes through shared memory, since gate (rows 0..R/2-1) and up of an intermediate column sit in other
        warps."""
        if GATED and R == 64 * WG:
            H: gl.constexpr = R // 2
            O_L: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [H // 32, 4 * WG // (H // 32)], [0, 1])  # coalesced
            buf = gl.allocate_shared_memory(gl.float32, [R, N], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
            cta_barrier()  # the buffer may reuse the ring's memory: every warp's last MMAs have read it
            buf.store(acc_a)
            cta_barrier()
            gate = buf.slice(0, H).load(O_L)
            up = buf.slice(H, H).load(O_L)
            act = gate / (1.0 + gl.exp(-gate)) * up
            _store_cols(out_ptr, _pair_ids(pairs_ptr, blk, P, N, NP, DIRECT, O_L),
                        gl.arange(0, H, layout=gl.SliceLayout(1, O_L)) + row0, act.to(out_ptr.dtype.element_ty), P,
                        N_OUT, stride_o)
        else:
            pairs = _pair_ids(pairs_ptr, blk, P, N, NP, DIRECT, ACC_L)
            orow = gl.arange(0, 64 * WG, layout=gl.SliceLayout(1, ACC_L)) + row0
            if GATED:
                act = acc_a / (1.0 + gl.exp(-acc_a)) * acc_b
                _store_cols(out_ptr, pairs, orow, act.to(out_ptr.dtype.element_ty), P, N_OUT, stride_o)
            else:
                _store_cols(out_ptr, pairs, orow, acc_a, P, N_OUT, stride_o)  # one accumulator: all R rows
                if R == 128 and WG == 1:
                    _store_cols(out_ptr, pairs, orow + 64, acc_b, P, N_OUT, stride_o)

    @gluon.jit
    def _zero_acc(N: gl.constexpr, WG: gl.constexpr, ACC_L: gl.constexpr, R: gl.constexpr = 128):
        """(acc_a, acc_b) at zero: [64, N] per weight tensor (R = 128 rows, one warpgroup), or the one [R, N]
        (R = 64 WG) under both names."""
        acc_a = gl.zeros([64 * WG, N], gl.float32, ACC_L)
        acc_b = acc_a
        if R == 128 and WG == 1:
            acc_b = gl.zeros([64, N], gl.float32, ACC_L)
        return acc_a, acc_b

    @gluon.jit
    def _ring_gemm(x_ptr, out_ptr, pairs_ptr, blk, pid_r, P, N_OUT, num_kb, stride_x, stride_o, w_src, w_ok, s_src,
                   s_ok, gw, gs, stride_wn, stride_sn8, stride_wk, stride_sk8, xring, wring, sring, TOPK: gl.constexpr,
                   GATED: gl.constexpr,
                   N: gl.constexpr, NP: gl.constexpr, STAGES: gl.constexpr, WPRE: gl.constexpr, DIRECT: gl.constexpr,
                   ROW_TILES: gl.constexpr, W_L: gl.constexpr, CW_L: gl.constexpr, CS_L: gl.constexpr,
                   WG: gl.constexpr):
        """The block's first N pair slots (of NP) through the K loop and the store: acc [64, N] per weight tensor,
        steps through the STAGES-slot ring (STAGES - 1 in flight), m64nNk16 MMAs. WPRE: the weights of the first
        STAGES - 1 steps are already in flight (one commit group per step, issued before this call). DIRECT: block
        `blk` is pair `blk` alone (slot 0; no block list). ROW_TILES > 1 (w2 only): the program's ROW_TILES row tiles
        one after the other through the same ring, which runs on across them (tile t + 1's first steps are copied
        during tile t's last), each tile's rows accumulated from zero in the same K order as alone. WG = 2: two
        warpgroups, one accumulator [128, N] (rows 0-63 tensor a in the first, 64-127 tensor b in the second). R (the
        ring slots' rows) = 64 with one warpgroup: one accumulator [64, N] (w13: 32 gate rows, then their 32 up rows;
        w2: 64 output rows), the rows the other cases split over two tensors."""
        R: gl.constexpr = wring.shape[1]
        ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * WG, 1],
                                                        instr_shape=[16, N, 16])
        A_L: gl.constexpr = gl.DotOperandLayout(0, ACC_L, 2)
        XC_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4 * WG, 1], [1, 0])  # 16-byte copies, [4 N, 64]
        slot_x = gl.arange(0, 4 * N, layout=gl.SliceLayout(1, XC_L)) % N
        if DIRECT:
            pairs_x = gl.where(slot_x == 0, blk, P)
        else:
            pairs_x = gl.load(pairs_ptr + blk * NP + slot_x)
        if GATED:
            xr = gl.where(pairs_x < P, pairs_x // TOPK, 0)  # padding slots read row 0 (never stored)
        else:
            xr = gl.where(pairs_x < P, pairs_x, 0)
        x_rows = x_ptr + xr.to(gl.int64) * stride_x

        if ROW_TILES == 1:
            for st in gl.static_range(STAGES - 1):
                if WPRE:  # groups: S - 1 of weights, then S - 1 of activations; wait_group(S - 2) stays sufficient
                    _copy_x(x_rows, st, st < num_kb, xring.index(st).slice(0, 4 * N), XC_L)
                else:
                    _copy_stage(x_rows, w_src, w_ok, s_src, s_ok, st, st < num_kb, xring.index(st).slice(0, 4 * N),
                                wring.index(st), sring.index(st), stride_wk, stride_sk8, XC_L)
                cp.commit_group()
            acc_a, acc_b = _zero_acc(N, WG, ACC_L, R)
            for kb in range(0, num_kb):
                nk = kb + STAGES - 1
                acc_a, acc_b = _ring_step(kb, x_rows, w_src, w_ok, s_src, s_ok, gl.minimum(nk, num_kb - 1),
                                          nk < num_kb, xring, wring, sring, acc_a, acc_b, stride_wk, stride_sk8, N,
                                          STAGES, W_L, A_L, XC_L, WG)
            cp.wait_group(0)
            if GATED:
                _store_rows(acc_a, acc_b, out_ptr, pairs_ptr, blk, pid_r * (R // 2), P, N_OUT, stride_o, GATED, N,
                            NP, DIRECT, ACC_L, WG, R)
            else:
                _store_rows(acc_a, acc_b, out_ptr, pairs_ptr, blk, pid_r * R, P, N_OUT, stride_o, GATED, N, NP,
                            DIRECT, ACC_L, WG, R)
        else:
            gl.static_assert(not GATED)
            total = ROW_TILES * num_kb  # ring steps: tile t's step kb is step t * num_kb + kb
            for st in gl.static_range(STAGES - 1):
                t0 = gl.minimum(st // num_kb, ROW_TILES - 1)
                sw, okw, ss, oks = _tile_src(w_src, s_src, gw, gs, N_OUT, stride_wn, stride_sn8, t0, CW_L, CS_L)
                if WPRE:
                    _copy_x(x_rows, st % num_kb, st < total, xring.index(st).slice(0, 4 * N), XC_L)
                else:
                    _copy_stage(x_rows, sw, okw, ss, oks, st % num_kb, st < total, xring.index(st).slice(0, 4 * N),
                                wring.index(st), sring.index(st), stride_wk, stride_sk8, XC_L)
                cp.commit_group()
            for t in range(0, ROW_TILES):
                acc_a, acc_b = _zero_acc(N, WG, ACC_L, R)
                for kb in range(0, num_kb):
                    f = t * num_kb + kb
                    nf = gl.minimum(f + STAGES - 1, total - 1)
                    sw, okw, ss, oks = _tile_src(w_src, s_src, gw, gs, N_OUT, stride_wn, stride_sn8, nf // num_kb,
                                                 CW_L, CS_L)
                    acc_a, acc_b = _ring_step(f, x_rows, sw, okw, ss, oks, nf % num_kb, f + STAGES - 1 < total,
                                              xring, wring, sring, acc_a, acc_b, stride_wk, stride_sk8, N, STAGES, W_L,
                                              A_L, XC_L, WG)
                _store_rows(acc_a, acc_b, out_ptr, pairs_ptr, blk, (pid_r * ROW_TILES + t) * R, P, N_OUT, stride_o,
                            GATED, N, NP, DIRECT, ACC_L, WG, R)
            cp.wait_group(0)

    @gluon.jit
    def _wgmma_body(
        x_ptr,  # w13: x [T, Kp] (rows gathered by pair // TOPK); w2: a [P, Kp] (rows by pair)
        w_ptr,  # int32 [E, N, Kp/8], "wgmma" layout (or its step-major order, "wgmma_steps": the strides say)
        s_ptr,  # bf16 [E, N, Kp/32] (likewise)
        out_ptr,  # w13: a [P, N/2] (activation dtype); w2: y [P, N] fp32
        pairs_ptr,  # int32 [blocks * NP] (DIRECT: not read)
        bexp_ptr,  # int32 [blocks] (DIRECT: the int64 expert ids of the pairs, one block per pair)
        P, N_OUT, num_kb,
        stride_x, stride_we, stride_wn, stride_wk, stride_se8, stride_sn8, stride_sk8, stride_o,  # scale strides
        # in 16-byte units; _wk / _sk8: from one of a row's K steps to the next
        TOPK: gl.constexpr, GATED: gl.constexpr, NP: gl.constexpr, SMALL: gl.constexpr, STAGES: gl.constexpr,
        PDL: gl.constexpr, DIRECT: gl.constexpr, ROW_TILES: gl.constexpr, WG: gl.constexpr, R: gl.constexpr,
        tw_ptr, comb_ptr, rows_ptr,  # COMBINE: the token's routing weights [TOPK], its output [D], row-range counts
        COMBINE: gl.constexpr,
    ):
        gl.static_assert(gl.num_warps() == 4 * WG)  # WG warpgroups: 1, or 2 splitting the 128 weight rows
        gl.static_assert(not COMBINE or (DIRECT and not GATED and WG == 1))  # w2 of one token, one warpgroup
        gl.static_assert(R == 128 or (R == 64 and WG == 1))  # weight rows per program (ring slot)
        gl.static_assert(STAGES >= 2)
        gl.static_assert(ROW_TILES == 1 or not GATED)  # row tiles per program: w2 only
        # words [64 WG rows, 4 t, 8 j] as _W_L1 (the second warpgroup, if any, holds rows 64-127)
        if WG == 1:
            W_L: gl.constexpr = _W_L1
            if R == 128:
                CS_L: gl.constexpr = _CS_L1
            else:
                CS_L: gl.constexpr = _CS_L64
        else:  # the second warpgroup holds rows 64-127 (tensor b), as its MMAs' accumulator rows
            W_L: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0]],
                lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                warp_bases=[[16, 0, 0], [32, 0, 0], [64, 0, 0]], block_bases=[], shape=[128, 4, 8])
            CS_L: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [8, 1], [1, 0])  # 8-byte copies, 256 threads
        CW_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4 * WG, 1], [1, 0])  # [128 rows, 32 words]
        X_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([4 * NP, 64], gl.bfloat16)
        W_SL: gl.constexpr = _W_SL
        S_SL: gl.constexpr = _S_SL

        pid_r = gl.program_id(0)
        blk = gl.program_id(1)
        WPRE: gl.constexpr = PDL and not GATED
        e = _block_expert(bexp_ptr, blk, PDL, GATED)
        if e < 0:
            return
        w_src, w_ok, s_src, s_ok, gw, gs = _weight_src(w_ptr, s_ptr, e, pid_r, N_OUT, stride_we, stride_wn,
                                                       stride_se8, stride_sn8, GATED, ROW_TILES, CW_L, CS_L, R)
        xring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 4 * NP, 64], X_SL)  # 4 chunks x NP slots per step
        wring = gl.allocate_shared_memory(gl.int32, [STAGES, R, 32], W_SL)
        sring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, R, 8], S_SL)
        if WPRE:
            _prefetch_w(w_src, w_ok, s_src, s_ok, gw, gs, N_OUT, num_kb, stride_wn, stride_sn8, stride_wk, stride_sk8,
                        wring, sring, STAGES, ROW_TILES, CW_L, CS_L)
            _gdc_launch_dependents()  # the combine may be scheduled; it waits for this grid's end
            _gdc_wait()
        if SMALL > 0 and not DIRECT:  # pairs in this block: a block that fits SMALL slots runs with N = SMALL
            fill = gl.sum((gl.load(pairs_ptr + blk * NP + gl.arange(0, NP, layout=gl.SliceLayout(1, CS_L))) < P)
                          .to(gl.int32), axis=0)
            if fill <= SMALL:
                _ring_gemm(x_ptr, out_ptr, pairs_ptr, blk, pid_r, P, N_OUT, num_kb, stride_x, stride_o, w_src, w_ok,
                           s_src, s_ok, gw, gs, stride_wn, stride_sn8, stride_wk, stride_sk8, xring, wring, sring, TOPK,
                           GATED, SMALL, NP, STAGES, WPRE, DIRECT, ROW_TILES, W_L, CW_L, CS_L, WG)
            else:
                _ring_gemm(x_ptr, out_ptr, pairs_ptr, blk, pid_r, P, N_OUT, num_kb, stride_x, stride_o, w_src, w_ok,
                           s_src, s_ok, gw, gs, stride_wn, stride_sn8, stride_wk, stride_sk8, xring, wring, sring, TOPK,
                           GATED, NP, NP, STAGES, WPRE, DIRECT, ROW_TILES, W_L, CW_L, CS_L, WG)
        else:  # one block size (DIRECT: one pair per block, so the small path when there is one)
            N1: gl.constexpr = SMALL if DIRECT and SMALL > 0 else NP
            _ring_gemm(x_ptr, out_ptr, pairs_ptr, blk, pid_r, P, N_OUT, num_kb, stride_x, stride_o, w_src, w_ok,
                       s_src, s_ok, gw, gs, stride_wn, stride_sn8, stride_wk, stride_sk8, xring, wring, sring, TOPK,
                       GATED, N1, NP, STAGES, WPRE, DIRECT, ROW_TILES, W_L, CW_L, CS_L, WG)
        if COMBINE:
            # the TOPK programs of a row range (one per slot) each count themselves once their y rows are stored; the
            # last one combines the range in slot order (the combine kernel's arithmetic) and re-arms the count
            _publish()
            if gl.atomic_add(rows_ptr + pid_r, 1, sem="acq_rel", scope="gpu") == TOPK - 1:
                _fence_gpu()
                _combine_rows(out_ptr, tw_ptr, comb_ptr, pid_r * (R * ROW_TILES), N_OUT, stride_o, TOPK,
                              R * ROW_TILES)
                gl.atomic_xchg(rows_ptr + pid_r, 0, sem="relaxed", scope="gpu")

    @gluon.jit
    def _moe_w13_wgmma_kernel(x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr, P, N_OUT, num_kb, stride_x,
                              stride_we, stride_wn, stride_wk, stride_se8, stride_sn8, stride_sk8, stride_o,
                              TOPK: gl.constexpr, NP: gl.constexpr, SMALL: gl.constexpr, STAGES: gl.constexpr,
                              PDL: gl.constexpr, DIRECT: gl.constexpr, WG: gl.constexpr, ROWS: gl.constexpr):
        """w13: a[pair, i] = silu(gate) * up for ROWS / 2 intermediate columns (N_OUT = I)."""
        _wgmma_body(x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr, P, N_OUT, num_kb, stride_x, stride_we,
                    stride_wn, stride_wk, stride_se8, stride_sn8, stride_sk8, stride_o, TOPK, True, NP, SMALL, STAGES,
                    PDL, DIRECT, 1, WG, ROWS, out_ptr, out_ptr, pairs_ptr, False)

    @gluon.jit
    def _moe_w2_wgmma_kernel(x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr, P, N_OUT, num_kb, stride_x,
                             stride_we, stride_wn, stride_wk, stride_se8, stride_sn8, stride_sk8, stride_o,
                             TOPK: gl.constexpr, NP: gl.constexpr, SMALL: gl.constexpr, STAGES: gl.constexpr,
                             PDL: gl.constexpr, DIRECT: gl.constexpr, ROW_TILES: gl.constexpr, WG: gl.constexpr,
                             ROWS: gl.constexpr):
        """w2: y[pair, d] (fp32, unweighted) for ROW_TILES x ROWS output rows (N_OUT = D)."""
        _wgmma_body(x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr, P, N_OUT, num_kb, stride_x, stride_we,
                    stride_wn, stride_wk, stride_se8, stride_sn8, stride_sk8, stride_o, TOPK, False, NP, SMALL, STAGES,
                    PDL, DIRECT, ROW_TILES, WG, ROWS, out_ptr, out_ptr, pairs_ptr, False)

    @gluon.jit
    def _moe_w2_combine_wgmma_kernel(x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr, P, N_OUT, num_kb, stride_x,
                                     stride_we, stride_wn, stride_wk, stride_se8, stride_sn8, stride_sk8, stride_o,
                                     tw_ptr, comb_ptr, rows_ptr, TOPK: gl.constexpr, NP: gl.constexpr,
                                     SMALL: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
                                     ROW_TILES: gl.constexpr, ROWS: gl.constexpr):
        """w2 of one token with direct blocks (`_moe_w2_wgmma_kernel`'s y rows, the same bits), and the combine:
        comb[d] = sum over slots k in order of tw[k] * y[k, d], by the last of a row range's TOPK programs, found by
        its count in rows_ptr[row range] (zero at launch, zero again when that program is done with it). No
        combine launch after it."""
        _wgmma_body(x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr, P, N_OUT, num_kb, stride_x, stride_we,
                    stride_wn, stride_wk, stride_se8, stride_sn8, stride_sk8, stride_o, TOPK, False, NP, SMALL, STAGES,
                    PDL, True, ROW_TILES, 1, ROWS, tw_ptr, comb_ptr, rows_ptr, True)
