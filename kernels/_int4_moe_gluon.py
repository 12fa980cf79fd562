"""Gluon (sm_80+ mma.sync) kernels of `kernels.int4_moe`: weights straight from global memory into the MMA.

The Triton kernels (`_int4_moe_kernels`) stage every weight tile through shared memory (cp.async, a CTA barrier
per pipeline stage, then shared-memory loads) and put the pairs on the MMA's M side. Here the layouts are
explicit, so the weights never touch shared memory:

  acc [ROWS, 8]  (weight rows x pairs)  +=  W [ROWS, 64] (operand A)  x  X [64, 8] (operand B)

with mma.sync m16n8k16 and both operands in the k_width = 8 dot layout: within every 32 columns of K, lane
quad q holds 8 consecutive columns, so ONE int32 word of 8 nibbles is exactly what a thread needs of one
weight row. Each thread loads its words with 16-byte vector loads (two per row per 256-column step), one step
ahead of the MMAs, dequantises them in registers and feeds the MMA; no shared memory, no CTA barrier. The
activations (x rows gathered by pair, or `a`) are loaded the same way, 16 bytes per load, from L1/L2. An expert
block of 8 x SUB pairs is SUB sub-blocks of 8: each dequantised chunk of weights goes to the MMAs of all of them
(a block with one sub-block's worth of pairs runs the one-sub-block loop instead: one decision per program), so
an expert's weights are read and dequantised once per block.

K order. A 256-column step holds 32 words of a row. The kernel's "logical" word w = 8c + 4r + q (chunk c of 64
columns, its half r, lane quad q) is the word at memory position 8q + 4r + c, so a thread's 8 words of the step
are contiguous in memory (two 16-byte loads) and cover the quantisation groups 2q and 2q + 1 (one 4-byte load
of scales per row); which step columns a word holds is chosen so that a lane's activations are 16 contiguous
columns (`kernels.int4_moe_gluon` doc). The product is the same sum, taken in another order than the Triton
kernels' (other bits; a deployment uses one implementation).

Dequant (PTX, per two weights): one lop3 puts the nibble pair into bf16 128 + u (Marlin's trick), one bf16x2
FMA gives q = u - 8 exactly, one multiplies by the group's scale and rounds once: bf16(q * s), the value of the
Triton kernels' PRESCALE path. The nibbles of a word are stored interleaved (k0 k2 k4 k6 k1 k3 k5 k7, made once
at load by `repack_int4_moe_for_gluon`) so that `(word >> 4i) & 0x000F000F` is the pair (2i, 2i + 1).

Batch invariance: a pair's column of the accumulator is computed from its own x row and the weights only
(mma.sync computes each output element independently), in a K order fixed by the layout, so its bits do not
depend on the other pairs of its block, the block size (SUB) or the launch.

Shapes: rows of one tensor per CTA = 16 x num_warps x RT (RT = 1 or 2 m16 tiles per warp: the activation loads
of a warp serve all its tiles), K padded to a multiple of 512 by the repack, 8 x SUB (SUB = 1, 2, 4) pairs per
expert block. bf16 activations, sm_80 or newer.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

# (128 + u) via lop3 into bf16 pairs, u - 8 exactly, times the group's scale (bf16x2 $3 = (s, s)) rounded once
_DEQUANT_PAIR_PTX = """{
.reg .b32 t, one, bias, nz;
mov.b32 one, 0x3F803F80;
mov.b32 bias, 0xC308C308;
mov.b32 nz, 0x80008000;
lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t, t, one, bias;
fma.rn.bf16x2 $0, t, $3, nz;
}"""

if HAVE_GLUON:
    _DEQUANT_PAIR = gl.constexpr(_DEQUANT_PAIR_PTX)

    @gluon.jit
    def _expand8(v):
        """[R, 8] -> [R, 64]: element 8w + 2i + b of the result is v[:, w] >> 4i (the word shifted for its
        nibble pair i), built by register-only joins."""
        s0 = v
        s1 = v >> 4
        s2 = v >> 8
        s3 = v >> 12
        u = gl.join(gl.join(s0, s2), gl.join(s1, s3))  # [R, 8, i1, i0] = s(2 i1 + i0); registers b, i0, i1
        u = gl.join(u, u)  # [R, 8, 2, 2, 2(b)]
        return gl.reshape(u, [v.shape[0], 64])

    @gluon.jit
    def _expand8_same(v):
        """[R, 8] -> [R, 64]: element 8w + j is v[:, w]."""
        u = gl.join(gl.join(v, v), gl.join(v, v))
        u = gl.join(u, u)
        return gl.reshape(u, [v.shape[0], 64])

    @gluon.jit
    def _chunks(w4):
        """[R, 4 q, 2 r, 4 c] (memory order) -> the four 64-column chunks c, each [R, 8] in logical word
        order 4r + q."""
        R: gl.constexpr = w4.shape[0]
        t = gl.reshape(gl.permute(w4, (0, 2, 1, 3)), [R, 2, 4, 2, 2])  # [R, r, q, c_hi, c_lo]
        e, o = gl.split(t)  # c_lo = 0 / 1
        c0, c2 = gl.split(e)
        c1, c3 = gl.split(o)
        return (gl.reshape(c0, [R, 8]), gl.reshape(c1, [R, 8]), gl.reshape(c2, [R, 8]), gl.reshape(c3, [R, 8]))

    @gluon.jit
    def _dequant_chunk(words, scales, A_L: gl.constexpr):
        """One 64-column chunk: words [R, 8] int32 and their scales [R, 8] bf16 -> bf16(q * s) [R, 64] in the
        MMA's A layout (register-only: the convert is asserted trivial)."""
        wx = _expand8(words)
        sx = gl.convert_layout(_expand8_same(scales), wx.type.layout, assert_trivial=True)
        deq = gl.inline_asm_elementwise(_DEQUANT_PAIR, "=r,r,r,r", [wx, sx], dtype=gl.bfloat16,
                                        is_pure=True, pack=2)
        return gl.convert_layout(deq, A_L, assert_trivial=True)

    @gluon.jit
    def _load_step(w_rows, s_rows, row_ok, s_ok, kb, EVEN: gl.constexpr, W_L: gl.constexpr, S_L: gl.constexpr):
        """One 256-column step of a tile's weight rows: words [R, 4 q, 2 r, 4 c] (each thread 8 contiguous
        words per row: memory word 8q + 4r + c of the step) and scales [R, 4 q, 2 h] (groups 2q + h)."""
        L3: gl.constexpr = gl.SliceLayout(3, W_L)
        L2: gl.constexpr = gl.SliceLayout(2, L3)
        q = gl.arange(0, 4, layout=gl.SliceLayout(0, L2))
        r = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3)))
        c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, W_L))))
        q4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(q * 8, 0), 2), 3)
        r4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(r * 4, 0), 0), 3)
        c4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(c, 0), 0), 0)
        p4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(w_rows + kb * 32, 1), 2), 3)
        ok4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(row_ok, 1), 2), 3)
        if EVEN:
            words = gl.load(p4 + (q4 + r4 + c4))
        else:
            words = gl.load(p4 + (q4 + r4 + c4), mask=ok4, other=0)
        S2: gl.constexpr = gl.SliceLayout(2, S_L)
        sq = gl.arange(0, 4, layout=gl.SliceLayout(0, S2))
        sr = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, S_L)))  # h: groups 2q, 2q + 1
        sq3 = gl.expand_dims(gl.expand_dims(sq * 2, 0), 2)
        sr3 = gl.expand_dims(gl.expand_dims(sr, 0), 0)
        sp3 = gl.expand_dims(gl.expand_dims(s_rows + kb * 8, 1), 2)
        sok3 = gl.expand_dims(gl.expand_dims(s_ok, 1), 2)
        if EVEN:
            scales = gl.load(sp3 + (sq3 + sr3))
        else:
            scales = gl.load(sp3 + (sq3 + sr3), mask=sok3, other=0.0)
        return words, scales

    @gluon.jit
    def _step_scales(scales):
        """[R, 4 q, 2 h] (groups 2q + h of the step) -> per half h, [R, 8] in logical word order 4r + q: the
        scales of chunks 2h and 2h + 1 (a word's group does not depend on r)."""
        R: gl.constexpr = scales.shape[0]
        s0, s1 = gl.split(scales)
        s0 = gl.reshape(gl.permute(gl.join(s0, s0), (0, 2, 1)), [R, 8])
        s1 = gl.reshape(gl.permute(gl.join(s1, s1), (0, 2, 1)), [R, 8])
        return s0, s1

    @gluon.jit
    def _x_chunk(x_cols, kb, c: gl.constexpr, X_L: gl.constexpr, B_L: gl.constexpr):
        """Activations of chunk c of step kb -> [64, NP] in the MMA's B layout. Lane quad q reads the 16
        contiguous columns 64q + 16c + e of the step (two 16-byte loads); e's bits are (j0, r, j1, j2) of the
        logical column 32r + 8q + j (module doc), so the relabelling is register-only."""
        NP: gl.constexpr = x_cols.shape[0]
        q = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, X_L)))
        e = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, X_L)))
        off = gl.expand_dims(q * 64, 1) + gl.expand_dims(e, 0) + (kb * 256 + c * 16)  # [4, 16]
        cols = gl.convert_layout(x_cols, gl.SliceLayout(0, gl.SliceLayout(0, X_L)))
        v = gl.load(gl.expand_dims(gl.expand_dims(cols, 0), 0) + gl.expand_dims(off, 2))  # [q, e, n]
        v = gl.permute(gl.reshape(v, [4, 2, 2, 2, 2, NP]), (3, 0, 1, 2, 4, 5))  # [r, q, j2, j1, j0, n]
        return gl.convert_layout(gl.reshape(v, [64, NP]), B_L, assert_trivial=True)

    @gluon.jit
    def _mma_chunk(accs, a_op, xcs, kb, c: gl.constexpr, SUB: gl.constexpr, X_L: gl.constexpr,
                   B_L: gl.constexpr):
        """One dequantised 64-column chunk `a_op` times the activations of the first SUB sub-blocks (no branch:
        the program picked SUB for its block once; an empty sub-block reads row 0 and is never stored)."""
        a0, a1, a2, a3 = accs
        x0, x1, x2, x3 = xcs
        a0 = mma_v2(a_op, _x_chunk(x0, kb, c, X_L, B_L), a0)
        if SUB >= 2:
            a1 = mma_v2(a_op, _x_chunk(x1, kb, c, X_L, B_L), a1)
        if SUB >= 4:
            a2 = mma_v2(a_op, _x_chunk(x2, kb, c, X_L, B_L), a2)
            a3 = mma_v2(a_op, _x_chunk(x3, kb, c, X_L, B_L), a3)
        return a0, a1, a2, a3

    @gluon.jit
    def _mma_step(accs, words, scales, xcs, kb, SUB: gl.constexpr, A_L: gl.constexpr, B_L: gl.constexpr,
                  X_L: gl.constexpr):
        """One K step of one weight tile: four 64-column chunks, each dequantised once for all sub-blocks."""
        w0, w1, w2, w3 = _chunks(words)
        s0, s1 = _step_scales(scales)
        accs = _mma_chunk(accs, _dequant_chunk(w0, s0, A_L), xcs, kb, 0, SUB, X_L, B_L)
        accs = _mma_chunk(accs, _dequant_chunk(w1, s0, A_L), xcs, kb, 1, SUB, X_L, B_L)
        accs = _mma_chunk(accs, _dequant_chunk(w2, s1, A_L), xcs, kb, 2, SUB, X_L, B_L)
        accs = _mma_chunk(accs, _dequant_chunk(w3, s1, A_L), xcs, kb, 3, SUB, X_L, B_L)
        return accs

    @gluon.jit
    def _load_both(wg, sg, wu, su, row_ok, srow_ok, kb, EVEN: gl.constexpr, GATED: gl.constexpr,
                   W_L: gl.constexpr, S_L: gl.constexpr):
        """Step kb's (words, scales) of the gate rows (w2: the rows) and, GATED, of the up rows."""
        qg, sc_g = _load_step(wg, sg, row_ok, srow_ok, kb, EVEN, W_L, S_L)
        if GATED:
            qu, sc_u = _load_step(wu, su, row_ok, srow_ok, kb, EVEN, W_L, S_L)
        else:
            qu, sc_u = qg, sc_g
        return qg, sc_g, qu, sc_u

    @gluon.jit
    def _step_both(acc_g, acc_u, buf, xcs, kb, GATED: gl.constexpr, SUB: gl.constexpr, A_L: gl.constexpr,
                   B_L: gl.constexpr, X_L: gl.constexpr):
        qg, sc_g, qu, sc_u = buf
        acc_g = _mma_step(acc_g, qg, sc_g, xcs, kb, SUB, A_L, B_L, X_L)
        if GATED:
            acc_u = _mma_step(acc_u, qu, sc_u, xcs, kb, SUB, A_L, B_L, X_L)
        return acc_g, acc_u

    @gluon.jit
    def _k_loop(wg, sg, wu, su, row_ok, srow_ok, xcs, num_kb, R: gl.constexpr, EVEN: gl.constexpr,
                GATED: gl.constexpr, SUB: gl.constexpr, P_L: gl.constexpr, A_L: gl.constexpr, B_L: gl.constexpr,
                X_L: gl.constexpr, W_L: gl.constexpr, S_L: gl.constexpr):
        """The K loop for the first SUB sub-blocks -> per sub-block accumulators (gate, up). Two K steps per
        iteration (num_kb is even: the repack pads K to 512), each step's weights loaded one step ahead into the
        other buffer (the last iteration reloads a step it had: an L2 hit, no branch)."""
        zero = gl.zeros([R, 8], gl.float32, P_L)
        acc_g = (zero, zero, zero, zero)  # per sub-block: gate rows (w2: the rows)
        acc_u = (zero, zero, zero, zero)  # per sub-block: up rows (w13)
        a = _load_both(wg, sg, wu, su, row_ok, srow_ok, 0, EVEN, GATED, W_L, S_L)
        for kb in range(0, num_kb, 2):
            b = _load_both(wg, sg, wu, su, row_ok, srow_ok, kb + 1, EVEN, GATED, W_L, S_L)
            acc_g, acc_u = _step_both(acc_g, acc_u, a, xcs, kb, GATED, SUB, A_L, B_L, X_L)
            a = _load_both(wg, sg, wu, su, row_ok, srow_ok, gl.minimum(kb + 2, num_kb - 1), EVEN, GATED, W_L, S_L)
            acc_g, acc_u = _step_both(acc_g, acc_u, b, xcs, kb + 1, GATED, SUB, A_L, B_L, X_L)
        return acc_g, acc_u

    @gluon.jit
    def _sub_block(pairs_ptr, blk, sb: gl.constexpr, P, x_ptr, stride_x, TOPK: gl.constexpr, GATED: gl.constexpr,
                   SUB: gl.constexpr, B_L: gl.constexpr):
        """Sub-block sb of expert block blk: its 8 pair ids, its activation row pointers (padding slots read row
        0, never stored) and whether it holds a pair (the align kernel puts an expert's padding last)."""
        pairs = gl.load(pairs_ptr + blk * (8 * SUB) + sb * 8 + gl.arange(0, 8, layout=gl.SliceLayout(0, B_L)))
        ok = pairs < P
        rows = pairs // TOPK if GATED else pairs
        cols = x_ptr + gl.where(ok, rows, 0).to(gl.int64) * stride_x
        return pairs, cols, gl.load(pairs_ptr + blk * (8 * SUB) + sb * 8) < P

    @gluon.jit
    def _store_sub(acc_g, acc_u, pairs, active, orow, out_ptr, P, N_OUT, stride_o, GATED: gl.constexpr,
                   P_L: gl.constexpr):
        if active:
            ocol = gl.convert_layout(pairs, gl.SliceLayout(0, P_L))
            optr = out_ptr + gl.expand_dims(ocol.to(gl.int64) * stride_o, 0) + gl.expand_dims(orow, 1)
            omask = gl.expand_dims(ocol < P, 0) & gl.expand_dims(orow < N_OUT, 1)
            if GATED:
                act = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u
                gl.store(optr, act.to(out_ptr.dtype.element_ty), mask=omask)
            else:
                gl.store(optr, acc_g, mask=omask)

    @gluon.jit
    def _moe_gluon_body(
        x_ptr,  # w13: x [T, Kp] (rows gathered by pair // TOPK); w2: a [P, Kp] (rows by pair)
        w_ptr,  # int32 [E, N, Kp/8]
        s_ptr,  # bf16 [E, N, Kp/32]
        out_ptr,  # w13: a [P, N/2] (activation dtype); w2: y [P, N] fp32
        pairs_ptr,  # int32 [blocks * 8 * SUB]
        bexp_ptr,  # int32 [blocks]
        P, N_OUT, num_kb,
        stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_o,
        TOPK: gl.constexpr, GATED: gl.constexpr, EVEN: gl.constexpr, SUB: gl.constexpr, RT: gl.constexpr,
    ):
        NW: gl.constexpr = 4
        gl.static_assert(gl.num_warps() == NW)
        gl.static_assert(RT == 1 or RT == 2)
        gl.static_assert(SUB == 1 or SUB == 2 or SUB == 4)
        R: gl.constexpr = 16 * NW * RT  # rows of one weight tile (w13: gate rows, and as many up rows)
        P_L: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
        A_L: gl.constexpr = gl.DotOperandLayout(0, P_L, 8)
        B_L: gl.constexpr = gl.DotOperandLayout(1, P_L, 8)
        # words [R, 4 q, 2 r, 4 c]: c and r in registers (8 contiguous words), q on lanes 0-1, rows as in A_L
        W_L: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [8, 0, 0, 0], [0, 0, 1, 0]] + ([[64, 0, 0, 0]] if RT == 2 else []),
            lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
            warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]],
            block_bases=[], shape=[R, 4, 2, 4])
        S_L: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [8, 0, 0]] + ([[64, 0, 0]] if RT == 2 else []),
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[R, 4, 2])
        # activations of one chunk and sub-block [4 q, 16 e, 8 pairs]: e in registers (16 contiguous columns)
        X_L: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0]],
            lane_bases=[[1, 0, 0], [2, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
            warp_bases=[[0, 0, 0], [0, 0, 0]], block_bases=[], shape=[4, 16, 8])
        ROW_L: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, W_L)))
        SROW_L: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, S_L))

        pid_r = gl.program_id(0)
        blk = gl.program_id(1)
        e = gl.load(bexp_ptr + blk)
        if e < 0:
            return
        rows = pid_r * R + gl.arange(0, R, layout=ROW_L)
        row_ok = rows < N_OUT
        srows = pid_r * R + gl.arange(0, R, layout=SROW_L)
        srow_ok = srows < N_OUT
        w_base = w_ptr + e.to(gl.int64) * stride_we
        s_base = s_ptr + e.to(gl.int64) * stride_se
        wg = w_base + rows * stride_wn
        sg = s_base + srows * stride_sn
        wu = w_base + (rows + N_OUT) * stride_wn  # w13: the up rows of the same intermediate columns
        su = s_base + (srows + N_OUT) * stride_sn
        p0, x0, _ = _sub_block(pairs_ptr, blk, 0, P, x_ptr, stride_x, TOPK, GATED, SUB, B_L)
        p1, x1, f1 = p0, x0, False
        p2, x2, f2 = p0, x0, False
        p3, x3, f3 = p0, x0, False
        if SUB >= 2:
            p1, x1, f1 = _sub_block(pairs_ptr, blk, 1, P, x_ptr, stride_x, TOPK, GATED, SUB, B_L)
        if SUB >= 4:
            p2, x2, f2 = _sub_block(pairs_ptr, blk, 2, P, x_ptr, stride_x, TOPK, GATED, SUB, B_L)
            p3, x3, f3 = _sub_block(pairs_ptr, blk, 3, P, x_ptr, stride_x, TOPK, GATED, SUB, B_L)
        xcs = (x0, x1, x2, x3)
        # one decision per program: a block whose pairs fit in sub-block 0 (every block at low load) runs the
        # one-sub-block loop; a fuller block runs all SUB sub-blocks without branches
        if SUB == 1:
            acc_g, acc_u = _k_loop(wg, sg, wu, su, row_ok, srow_ok, xcs, num_kb, R, EVEN, GATED, 1, P_L, A_L, B_L,
                                   X_L, W_L, S_L)
        elif f1:
            acc_g, acc_u = _k_loop(wg, sg, wu, su, row_ok, srow_ok, xcs, num_kb, R, EVEN, GATED, SUB, P_L, A_L,
                                   B_L, X_L, W_L, S_L)
        else:
            acc_g, acc_u = _k_loop(wg, sg, wu, su, row_ok, srow_ok, xcs, num_kb, R, EVEN, GATED, 1, P_L, A_L, B_L,
                                   X_L, W_L, S_L)

        orow = pid_r * R + gl.arange(0, R, layout=gl.SliceLayout(1, P_L))
        _store_sub(acc_g[0], acc_u[0], p0, True, orow, out_ptr, P, N_OUT, stride_o, GATED, P_L)
        if SUB >= 2:
            _store_sub(acc_g[1], acc_u[1], p1, f1, orow, out_ptr, P, N_OUT, stride_o, GATED, P_L)
        if SUB >= 4:
            _store_sub(acc_g[2], acc_u[2], p2, f2, orow, out_ptr, P, N_OUT, stride_o, GATED, P_L)
            _store_sub(acc_g[3], acc_u[3], p3, f3, orow, out_ptr, P, N_OUT, stride_o, GATED, P_L)

    @gluon.jit
    def _moe_w13_gluon_kernel(x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr, P, N_OUT, num_kb, stride_x,
                              stride_we, stride_wn, stride_se, stride_sn, stride_o, TOPK: gl.constexpr,
                              EVEN: gl.constexpr, SUB: gl.constexpr, RT: gl.constexpr):
        """w13: a[pair, i] = silu(gate) * up for the intermediate columns of this program (N_OUT = I)."""
        _moe_gluon_body(x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr, P, N_OUT, num_kb, stride_x, stride_we,
                        stride_wn, stride_se, stride_sn, stride_o, TOPK, True, EVEN, SUB, RT)

    @gluon.jit
    def _moe_w2_gluon_kernel(x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr, P, N_OUT, num_kb, stride_x,
                             stride_we, stride_wn, stride_se, stride_sn, stride_o, TOPK: gl.constexpr,
                             EVEN: gl.constexpr, SUB: gl.constexpr, RT: gl.constexpr):
        """w2: y[pair, d] (fp32, unweighted) for the output rows of this program (N_OUT = D)."""
        _moe_gluon_body(x_ptr, w_ptr, s_ptr, out_ptr, pairs_ptr, bexp_ptr, P, N_OUT, num_kb, stride_x, stride_we,
                        stride_wn, stride_se, stride_sn, stride_o, TOPK, False, EVEN, SUB, RT)
