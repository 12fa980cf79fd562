"""Triton kernels of `kernels.int4_moe` (w4a16 grouped GEMMs over expert blocks, plus the combine).

Weights are in the GPU layout made by `int4_moe.repack_int4_moe_for_gpu` (K padded to a multiple
of 256; within each 256-column block, word j of a row holds column 32k + j in nibble k, so nibble k
of a [rows, 32]-word tile is exactly quantisation group k of the block):
  packed int32 [E, N, Kp/8]          scale [E, Kp/256, 8, N] (bf16, group-major so loads are rows)

A tile is one block of BLOCK_M pairs of one expert (see `_moe_align`) times a slice of output rows;
its program streams the whole K extent in 256-column steps (8 groups). Per group k the int4 words are
dequantised in registers (`_int4_dequant`: PTX prmt/lop3/bf16x2-FMA on the GPU, a portable fp32 path
in the interpreter; both give identical values) and one MMA adds Q_k X_k^T. Variants (constexpr):
  SWAP        pairs on the MMA's M side, acc [BLOCK_M, ROWS] (mma.sync; the default) or on the N side,
              acc [ROWS, BLOCK_M] (wgmma with the weights as the register A operand: one MMA wait per
              group, slower here)
  PRESCALE    dequantise to bf16(q * s) and chain the 8 MMAs into one accumulator (default), or keep
              q exact and fold each group product in with its fp32 scale.
  ACC_CHAINS  1, 2 or 4 independent MMA accumulator chains per K step (PRESCALE; the partial sums are added at
              the end of the step in a fixed order): shorter dependency chains of mma.sync, other bits than 1
  ZP_MMA      the zero point out of the dequant: weights bf16(u * s) of the raw nibble u = q + 8 (one FMA per two
              weights instead of two, `_int4_dequant._dequant8_zp`); after the K loop `_zp_correction` adds
              sum_g (-8 s_g) * (sum of x over group g) by MMAs of 4 K blocks each, with the group sums (times
              -8, split into bf16 hi + lo, exact to ~2^-17) precomputed per activation row: by
              `_group_sums_kernel` for x, in the w13 epilogue for `a`. Other bits than without it (bf16(u * s)
              is rounded at other magnitudes than bf16(q * s)); needs PRESCALE. Measured 10-13% slower on the
              H200 (docs/performance.md), kept as an option.
Variants that change the schedule or the loads but not the arithmetic (bitwise equal to the same
configuration without them; tested):
  TILED       the weights in the tiled layout (`int4_moe.tile_int4_moe_weights`): each program's rows of one K
              block are one contiguous 8 KB run, and its K blocks follow each other, so a program streams one
              contiguous range instead of ROWS rows of 128 bytes far apart (DRAM page locality); addresses only
  SCALE_TILE  a step's 8 x ROWS scales as one [ROWS, 8] load (16-byte vectors, cp.async, prefetched by
              the software pipeliner with the weights) instead of 8 two-byte loads per thread that stay
              synchronous in the loop (`_int4_dequant._scales8`)
  K_UNROLL    K blocks per loop iteration (the first num_kb % K_UNROLL before the loop, one by one)
  PERSISTENT  a 1-D grid of at most (SMs x resident CTAs) programs; program p takes tiles p, p + grid,
              ... (tile = block * row tiles + row tile, over the used blocks only) in ONE loop over
              (tile, K step) pairs, set-up under `kb == 0`, epilogue under `kb == last` (the pattern of
              Triton's persistent-matmul tutorial), so the software pipeliner issues the next tile's
              first loads while the current tile finishes, and there is no tail wave of short CTAs.
              Needs num_kb % K_UNROLL == 0. Without it: grid (row tiles, blocks), one tile per program,
              blocks of expert -1 exit at once.
The K loop order is fixed (no split-K), so a pair's result does not depend on which other pairs
share its block or the launch (batch invariance), in every variant.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kernels._int4_dequant import _dequant8, _dequant8_scaled, _dequant8_zp, _scales8

BLOCK_K = tl.constexpr(256)  # columns per K step: 8 groups of 32, one nibble position each
ZP_COLS = tl.constexpr(16)  # per K step and activation row: -8 x the 8 group sums, bf16 hi then lo


@triton.jit
def _halve(v, H: tl.constexpr):
    # [A, 2H, B] -> [A, H, B]: element i + element i + H
    a, b = tl.split(tl.permute(tl.reshape(v, [v.shape[0], 2, H, v.shape[2]]), (0, 2, 3, 1)))
    return a + b


@triton.jit
def _tree_sum32(v):
    """[A, 32, B] fp32 -> [A, B]: halves added level by level, so the order of the additions is the code's, not
    the layout's (a tl.sum reduces in an order that follows the layout, which differs between kernel variants)."""
    v = _halve(_halve(_halve(_halve(_halve(v, 16), 8), 4), 2), 1)
    return tl.reshape(v, [v.shape[0], v.shape[2]])


@triton.jit
def _store_zp_sums(xs_ptrs, sums, mask):
    # sums [A, B] fp32 group sums -> -8 * sums as bf16-or-DTYPE hi at xs_ptrs, lo at xs_ptrs + 8
    v = sums * -8.0
    hi = v.to(xs_ptrs.dtype.element_ty)
    tl.store(xs_ptrs, hi, mask=mask)
    tl.store(xs_ptrs + 8, (v - hi.to(tl.float32)).to(xs_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _group_sums_kernel(x_ptr, xs_ptr, K, G, stride_xt, stride_xs, BLOCK_G: tl.constexpr):
    """xs [rows, (Kp / 256) * ZP_COLS]: for each 256-column block of a row of x, -8 x the sums of its 8 groups
    of 32 columns (zero past K), hi (index g) then lo (8 + g); G = Kp / 32 groups. One program per
    (row, BLOCK_G groups)."""
    r = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    col = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + r * stride_xt + col, mask=col < K, other=0.0).to(tl.float32)
    sums = _tree_sum32(tl.reshape(x, [BLOCK_G, 32, 1]))  # [BLOCK_G, 1]
    off = (g // 8) * ZP_COLS + g % 8
    _store_zp_sums(xs_ptr + r * stride_xs + off[:, None], sums, (g < G)[:, None])


@triton.jit
def _xt(x_ptrs, x_ok, c, K, EVEN: tl.constexpr):
    # x^T tile [32, BLOCK_M] of one quantisation group; padding pairs and columns past K read as 0
    # (masked lanes fetch nothing: at T=1 only 1 of the 16 pair columns costs cache bandwidth)
    if EVEN:
        return tl.load(x_ptrs, mask=x_ok, other=0.0)
    else:
        return tl.load(x_ptrs, mask=x_ok & (c < K), other=0.0)


@triton.jit
def _mma(q, xt, acc, PREC: tl.constexpr, SWAP: tl.constexpr):
    # q [ROWS, 32] weights, xt [32, BLOCK_M]: acc [ROWS, BLOCK_M] += q @ xt, or with SWAP the same
    # product transposed, acc [BLOCK_M, ROWS] += xt^T @ q^T (pairs on the MMA's M side)
    if SWAP:
        return tl.dot(tl.trans(xt), tl.trans(q), acc, input_precision=PREC)
    else:
        return tl.dot(q, xt, acc, input_precision=PREC)


@triton.jit
def _scaled(p, s, SWAP: tl.constexpr):
    # group product times its per-weight-row fp32 scale
    if SWAP:
        return p * s.to(tl.float32)[None, :]
    else:
        return p * s.to(tl.float32)[:, None]


@triton.jit
def _int4_kstep(acc, x_ptrs, x_ok, c, K, w_ptrs, w_ok, s_ptrs, stride_sk,
                DTYPE: tl.constexpr, USE_ASM: tl.constexpr, PREC: tl.constexpr,
                EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PRESCALE: tl.constexpr, SWAP: tl.constexpr,
                SCALE_TILE: tl.constexpr, ZP: tl.constexpr, CHAINS: tl.constexpr):
    """One 256-column block: acc += W[rows, block] @ X[:, block]^T, acc in MMA orientation (see _mma).

    Pointers at the block (w_ptrs [ROWS, 32] words, s_ptrs [ROWS] scales of group 0, x_ptrs [32, BLOCK_M]
    column j of group 0 per pair); c [32, 1] the block's first 32 column indices (masks past K). ZP: weights
    without their zero point (`_zp_correction` adds it after the last block).
    """
    if EVEN_N:
        w = tl.load(w_ptrs)  # [ROWS, 32] int32: 128 contiguous bytes per row
    else:
        w = tl.load(w_ptrs, mask=w_ok[:, None], other=0)
    x0 = _xt(x_ptrs, x_ok, c, K, EVEN_K)
    x1 = _xt(x_ptrs + 32, x_ok, c + 32, K, EVEN_K)
    x2 = _xt(x_ptrs + 64, x_ok, c + 64, K, EVEN_K)
    x3 = _xt(x_ptrs + 96, x_ok, c + 96, K, EVEN_K)
    x4 = _xt(x_ptrs + 128, x_ok, c + 128, K, EVEN_K)
    x5 = _xt(x_ptrs + 160, x_ok, c + 160, K, EVEN_K)
    x6 = _xt(x_ptrs + 192, x_ok, c + 192, K, EVEN_K)
    x7 = _xt(x_ptrs + 224, x_ok, c + 224, K, EVEN_K)
    s0, s1, s2, s3, s4, s5, s6, s7 = _scales8(s_ptrs, stride_sk, w_ok, EVEN_N, SCALE_TILE)
    if PRESCALE:
        if ZP:
            q0, q1, q2, q3, q4, q5, q6, q7 = _dequant8_zp(w, s0, s1, s2, s3, s4, s5, s6, s7, DTYPE, USE_ASM)
        else:
            q0, q1, q2, q3, q4, q5, q6, q7 = _dequant8_scaled(w, s0, s1, s2, s3, s4, s5, s6, s7, DTYPE, USE_ASM)
        if CHAINS == 1:  # one accumulator: 8 groups x K / 16 MMAs in one dependency chain per step
            acc = _mma(q0, x0, acc, PREC, SWAP)
            acc = _mma(q1, x1, acc, PREC, SWAP)
            acc = _mma(q2, x2, acc, PREC, SWAP)
            acc = _mma(q3, x3, acc, PREC, SWAP)
            acc = _mma(q4, x4, acc, PREC, SWAP)
            acc = _mma(q5, x5, acc, PREC, SWAP)
            acc = _mma(q6, x6, acc, PREC, SWAP)
            acc = _mma(q7, x7, acc, PREC, SWAP)
        elif CHAINS == 2:  # even / odd groups in two independent chains, added at the end of the step
            b = _mma(q1, x1, None, PREC, SWAP)
            acc = _mma(q0, x0, acc, PREC, SWAP)
            b = _mma(q3, x3, b, PREC, SWAP)
            acc = _mma(q2, x2, acc, PREC, SWAP)
            b = _mma(q5, x5, b, PREC, SWAP)
            acc = _mma(q4, x4, acc, PREC, SWAP)
            b = _mma(q7, x7, b, PREC, SWAP)
            acc = _mma(q6, x6, acc, PREC, SWAP) + b
        else:  # four chains (groups k, k + 4), added pairwise
            b1 = _mma(q1, x1, None, PREC, SWAP)
            b2 = _mma(q2, x2, None, PREC, SWAP)
            b3 = _mma(q3, x3, None, PREC, SWAP)
            acc = _mma(q0, x0, acc, PREC, SWAP)
            b1 = _mma(q5, x5, b1, PREC, SWAP)
            b2 = _mma(q6, x6, b2, PREC, SWAP)
            b3 = _mma(q7, x7, b3, PREC, SWAP)
            acc = _mma(q4, x4, acc, PREC, SWAP) + (b1 + (b2 + b3))
    else:
        q0, q1, q2, q3, q4, q5, q6, q7 = _dequant8(w, DTYPE, USE_ASM)
        acc += _scaled(_mma(q0, x0, None, PREC, SWAP), s0, SWAP)
        acc += _scaled(_mma(q1, x1, None, PREC, SWAP), s1, SWAP)
        acc += _scaled(_mma(q2, x2, None, PREC, SWAP), s2, SWAP)
        acc += _scaled(_mma(q3, x3, None, PREC, SWAP), s3, SWAP)
        acc += _scaled(_mma(q4, x4, None, PREC, SWAP), s4, SWAP)
        acc += _scaled(_mma(q5, x5, None, PREC, SWAP), s5, SWAP)
        acc += _scaled(_mma(q6, x6, None, PREC, SWAP), s6, SWAP)
        acc += _scaled(_mma(q7, x7, None, PREC, SWAP), s7, SWAP)
    return acc


@triton.jit
def _int4_ksteps(acc, x_ptrs, x_ok, kb, K, w_ptrs, w_ok, s_ptrs, stride_sb, stride_sk, STEPS: tl.constexpr,
                 DTYPE: tl.constexpr, USE_ASM: tl.constexpr, PREC: tl.constexpr,
                 EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PRESCALE: tl.constexpr, SWAP: tl.constexpr,
                 SCALE_TILE: tl.constexpr, ZP: tl.constexpr, TILED: tl.constexpr, CHAINS: tl.constexpr):
    """STEPS consecutive K blocks kb, kb + 1, ... (_int4_kstep each, unrolled); pointers in at block kb,
    returned advanced past the last one: (acc, x_ptrs, w_ptrs, s_ptrs)."""
    col = tl.arange(0, 32)[:, None]
    for u in tl.static_range(STEPS):
        acc = _int4_kstep(acc, x_ptrs, x_ok, (kb + u) * BLOCK_K + col, K, w_ptrs, w_ok, s_ptrs, stride_sk,
                          DTYPE, USE_ASM, PREC, EVEN_K, EVEN_N, PRESCALE, SWAP, SCALE_TILE, ZP, CHAINS)
        if TILED:  # the next block of the tile's rows is the next ROWS x 32 words
            w_ptrs += 32 * w_ptrs.shape[0]
        else:
            w_ptrs += 32
        x_ptrs += BLOCK_K
        s_ptrs += stride_sb
    return acc, x_ptrs, w_ptrs, s_ptrs


ZP_BLOCKS = tl.constexpr(4)  # K blocks per MMA of the zero-point correction (k = 4 x ZP_COLS = 64)


@triton.jit
def _zp_correction(acc, zs_ptrs, x_ok, s_ptrs, w_ok, stride_sb, stride_sk, num_kb, DTYPE: tl.constexpr,
                   PREC: tl.constexpr, SWAP: tl.constexpr):
    """ZP_MMA, after the K loop: acc (MMA orientation) += sum over every group G of s[row, G] * (-8 sum of x over
    G), hi and lo, as MMAs of ZP_BLOCKS K blocks each ([ROWS, 64] scales x [64, BLOCK_M] sums) in block order.
    zs_ptrs [1, BLOCK_M] each pair's row of sums, s_ptrs [ROWS] at K block 0. Outside the K loop, so the loop keeps its
    registers and its pipeline; the scales are read a second time (L2: the loop just streamed them)."""
    cols = tl.arange(0, ZP_BLOCKS * ZP_COLS)
    blk = cols // ZP_COLS
    s_off = (blk * stride_sb + (cols % 8) * stride_sk)[None, :]
    for kb in range(0, num_kb, ZP_BLOCKS):
        ok = kb + blk < num_kb
        cs = tl.load(s_ptrs[:, None] + kb * stride_sb + s_off, mask=w_ok[:, None] & ok[None, :], other=0.0)
        zs = tl.load(zs_ptrs + kb * ZP_COLS + cols[:, None], mask=x_ok & ok[:, None], other=0.0)
        acc = _mma(cs.to(DTYPE), zs, acc, PREC, SWAP)
    return acc


@triton.jit
def _swap(acc, SWAP: tl.constexpr):
    # [ROWS, BLOCK_M] <-> the MMA orientation of acc (transposed with SWAP, see _mma)
    if SWAP:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def _int4_block_gemm(acc, x_ptrs, x_ok, K, w_ptrs, w_ok, s_ptrs, stride_sb, stride_sk, zs_ptrs, num_kb,
                     DTYPE: tl.constexpr, USE_ASM: tl.constexpr, PREC: tl.constexpr, EVEN_K: tl.constexpr,
                     EVEN_N: tl.constexpr, PRESCALE: tl.constexpr, SWAP: tl.constexpr, SCALE_TILE: tl.constexpr,
                     K_UNROLL: tl.constexpr, ZP: tl.constexpr, TILED: tl.constexpr, CHAINS: tl.constexpr):
    """acc [ROWS, BLOCK_M] += W[rows, :K] @ X^T over the whole K extent, in a fixed order.

    x_ptrs [32, BLOCK_M]: column j of group 0 for each pair's activation row; x_ok [1, BLOCK_M]
    False for padding pairs (never stored). PRESCALE: the weights are dequantised with their scale
    (bf16(q * s), as a bf16 dequant would) and the 8 group MMAs chain into acc; otherwise each group
    MMA runs on the exact q and is folded into acc with its fp32 scale (more exact, 8 MMA waits).
    SWAP computes the transposed product (see _mma); acc goes in and out as [ROWS, BLOCK_M].
    K_UNROLL blocks per loop iteration; the first num_kb % K_UNROLL blocks go one by one before the
    loop, so the blocks and the MMA chain are in the same order whatever K_UNROLL is (bitwise equal).
    """
    acc = _swap(acc, SWAP)
    kb0 = 0
    if K_UNROLL > 1:
        kb0 = num_kb % K_UNROLL
        for u in tl.static_range(K_UNROLL - 1):
            if u < kb0:
                acc, x_ptrs, w_ptrs, s_ptrs = _int4_ksteps(
                    acc, x_ptrs, x_ok, u, K, w_ptrs, w_ok, s_ptrs, stride_sb, stride_sk, 1, DTYPE, USE_ASM,
                    PREC, EVEN_K, EVEN_N, PRESCALE, SWAP, SCALE_TILE, ZP, TILED, CHAINS)
    for kb in range(kb0, num_kb, K_UNROLL):
        acc, x_ptrs, w_ptrs, s_ptrs = _int4_ksteps(
            acc, x_ptrs, x_ok, kb, K, w_ptrs, w_ok, s_ptrs, stride_sb, stride_sk, K_UNROLL, DTYPE, USE_ASM,
            PREC, EVEN_K, EVEN_N, PRESCALE, SWAP, SCALE_TILE, ZP, TILED, CHAINS)
    if ZP:
        acc = _zp_correction(acc, zs_ptrs, x_ok, s_ptrs - num_kb * stride_sb, w_ok, stride_sb, stride_sk, num_kb,
                             DTYPE, PREC, SWAP)
    return _swap(acc, SWAP)


@triton.jit
def _num_used_blocks(bexp_ptr, nblk):
    # `_moe_align` numbers the used blocks 0..n-1 and marks the rest -1: n (one load per 1024 blocks)
    n = 0
    for start in tl.range(0, nblk, 1024, num_stages=1):
        b = start + tl.arange(0, 1024)
        n += tl.sum((tl.load(bexp_ptr + b, mask=b < nblk, other=-1) >= 0).to(tl.int32))
    return n


@triton.jit
def _w13_tile(e, pair, r, x_ptr, w_ptr, s_ptr, xs_ptr, P, I, num_kb, stride_xt, stride_we, stride_wn, stride_se,
              stride_xs, TOPK: tl.constexpr, BLOCK_I: tl.constexpr, TILED: tl.constexpr):
    """w13 tile of expert e (int64), pairs `pair` [BLOCK_M], intermediate columns r * BLOCK_I + [0, BLOCK_I):
    (ok [BLOCK_M] real pairs, row_ok [2 * BLOCK_I], w_ptrs, s_ptrs, x_ptrs, zs_ptrs) at K block 0 (no loads)."""
    ok = pair < P
    rr = tl.arange(0, 2 * BLOCK_I)
    n = r * BLOCK_I + rr % BLOCK_I  # intermediate column of this row
    row = n + (rr // BLOCK_I) * I  # rows 0..BLOCK_I-1: gate, BLOCK_I..: the matching up rows
    row_ok = n < I
    if TILED:  # tile r's K blocks one after another, each its 2 * BLOCK_I rows x 32 words (gate rows, up rows)
        w_off = tl.cast(r, tl.int64) * (num_kb * 2 * BLOCK_I * 32) + rr * 32
    else:
        w_off = row * stride_wn
    w_ptrs = w_ptr + e * stride_we + w_off[:, None] + tl.arange(0, 32)[None, :]
    s_ptrs = s_ptr + e * stride_se + row
    tok = (tl.where(ok, pair, 0) // TOPK)[None, :]
    x_ptrs = x_ptr + tok * stride_xt + tl.arange(0, 32)[:, None]
    zs_ptrs = xs_ptr + tok * stride_xs
    return ok, row_ok, w_ptrs, s_ptrs, x_ptrs, zs_ptrs


@triton.jit
def _w13_store(acc, a_ptr, pair, ok, r, I, stride_ap, as_ptr, stride_as, BLOCK_I: tl.constexpr,
               BLOCK_M: tl.constexpr, ZP: tl.constexpr):
    """acc [2 * BLOCK_I, BLOCK_M] gate rows then up rows -> silu(gate) * up of intermediate columns r * BLOCK_I + ..
    ZP: also the w2 kernel's group sums of those columns as stored (BLOCK_I % 32 == 0: whole groups; columns
    past I are 0) into as_ptr [P, (Ip / 256) * ZP_COLS]."""
    gate, up = tl.split(tl.permute(tl.reshape(acc, [2, BLOCK_I, BLOCK_M]), (1, 2, 0)))  # [BLOCK_I, BLOCK_M]
    act = (gate / (1.0 + tl.exp(-gate)) * up).to(a_ptr.dtype.element_ty)
    n_out = r * BLOCK_I + tl.arange(0, BLOCK_I)
    tl.store(a_ptr + pair[None, :] * stride_ap + n_out[:, None], act, mask=(n_out < I)[:, None] & ok[None, :])
    if ZP:
        NG: tl.constexpr = BLOCK_I // 32
        act = tl.where((n_out < I)[:, None], act.to(tl.float32), 0.0)
        sums = _tree_sum32(tl.reshape(act, [NG, 32, BLOCK_M]))  # [NG, BLOCK_M]
        g = r * NG + tl.arange(0, NG)
        off = (g // 8) * ZP_COLS + g % 8
        _store_zp_sums(as_ptr + pair[None, :] * stride_as + off[:, None], sums, ok[None, :])


@triton.jit(do_not_specialize=["nblk"])
def _moe_w13_kernel(
    x_ptr,  # [T, D] activations
    w_ptr, s_ptr,  # w13 GPU layout: int32 [E, 2I, Dp/8], scale [E, Dp/256, 8, 2I]
    a_ptr,  # out: [P, I] silu(gate) * up per pair, activation dtype
    pairs_ptr, bexp_ptr,  # from _moe_align
    xs_ptr, as_ptr,  # ZP_MMA: x's group sums [T, ...] (in), a's [P, ...] (out); see _group_sums_kernel
    P, D, I, num_kb, nblk,  # nblk = len(bexp) (PERSISTENT only)
    stride_xt, stride_we, stride_wn, stride_se, stride_sb, stride_sk, stride_ap, stride_xs, stride_as,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
    DTYPE: tl.constexpr, USE_ASM: tl.constexpr, PREC: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PRESCALE: tl.constexpr, SWAP: tl.constexpr,
    SCALE_TILE: tl.constexpr, K_UNROLL: tl.constexpr, PERSISTENT: tl.constexpr, ZP_MMA: tl.constexpr,
    TILED: tl.constexpr, ACC_CHAINS: tl.constexpr,
):
    if PERSISTENT:  # grid (programs,): tiles pid, pid + programs, ... in one flattened (tile, K block) loop
        pid = tl.program_id(0)
        n_rt = tl.cdiv(I, BLOCK_I)  # row tiles per block; tile = block * n_rt + row tile
        n_tiles = _num_used_blocks(bexp_ptr, nblk) * n_rt
        tile = pid - tl.num_programs(0)
        kb = num_kb - K_UNROLL
        pair = tl.full([BLOCK_M], 0, tl.int32)  # placeholders until the first tile's (kb == 0) set-up
        ok, row_ok, w_ptrs, s_ptrs, x_ptrs, zs_ptrs = _w13_tile(0, pair, 0, x_ptr, w_ptr, s_ptr, xs_ptr, P, I,
                                                               num_kb, stride_xt, stride_we, stride_wn, stride_se,
                                                               stride_xs, TOPK, BLOCK_I, TILED)
        acc = _swap(tl.zeros([2 * BLOCK_I, BLOCK_M], dtype=tl.float32), SWAP)
        for _ in range(0, tl.cdiv(n_tiles - pid, tl.num_programs(0)) * (num_kb // K_UNROLL)):
            kb = tl.where(kb == num_kb - K_UNROLL, 0, kb + K_UNROLL)
            if kb == 0:
                tile += tl.num_programs(0)
                b = tile // n_rt
                e = tl.load(bexp_ptr + b).to(tl.int64)
                pair = tl.load(pairs_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
                ok, row_ok, w_ptrs, s_ptrs, x_ptrs, zs_ptrs = _w13_tile(
                    e, pair, tile % n_rt, x_ptr, w_ptr, s_ptr, xs_ptr, P, I, num_kb, stride_xt, stride_we,
                    stride_wn, stride_se, stride_xs, TOPK, BLOCK_I, TILED)
            acc, x_ptrs, w_ptrs, s_ptrs = _int4_ksteps(
                acc, x_ptrs, ok[None, :], kb, D, w_ptrs, row_ok, s_ptrs, stride_sb, stride_sk, K_UNROLL,
                DTYPE, USE_ASM, PREC, EVEN_K, EVEN_N, PRESCALE, SWAP, SCALE_TILE, ZP_MMA, TILED, ACC_CHAINS)
            if kb == num_kb - K_UNROLL:
                if ZP_MMA:
                    acc = _zp_correction(acc, zs_ptrs, ok[None, :], s_ptrs - num_kb * stride_sb, row_ok, stride_sb,
                                         stride_sk, num_kb, DTYPE, PREC, SWAP)
                _w13_store(_swap(acc, SWAP), a_ptr, pair, ok, tile % n_rt, I, stride_ap, as_ptr, stride_as, BLOCK_I,
                           BLOCK_M, ZP_MMA)
                acc = _swap(tl.zeros([2 * BLOCK_I, BLOCK_M], dtype=tl.float32), SWAP)
    else:  # grid (row tiles, blocks): one tile per program
        pid_n = tl.program_id(0)
        pid_b = tl.program_id(1)
        e = tl.load(bexp_ptr + pid_b)
        if e < 0:
            return
        pair = tl.load(pairs_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
        ok, row_ok, w_ptrs, s_ptrs, x_ptrs, zs_ptrs = _w13_tile(
            e.to(tl.int64), pair, pid_n, x_ptr, w_ptr, s_ptr, xs_ptr, P, I, num_kb, stride_xt, stride_we,
            stride_wn, stride_se, stride_xs, TOPK, BLOCK_I, TILED)
        acc = tl.zeros([2 * BLOCK_I, BLOCK_M], dtype=tl.float32)
        acc = _int4_block_gemm(acc, x_ptrs, ok[None, :], D, w_ptrs, row_ok, s_ptrs, stride_sb, stride_sk, zs_ptrs,
                               num_kb, DTYPE, USE_ASM, PREC, EVEN_K, EVEN_N, PRESCALE, SWAP, SCALE_TILE, K_UNROLL,
                               ZP_MMA, TILED, ACC_CHAINS)
        _w13_store(acc, a_ptr, pair, ok, pid_n, I, stride_ap, as_ptr, stride_as, BLOCK_I, BLOCK_M, ZP_MMA)


@triton.jit
def _w2_tile(e, pair, r, a_ptr, w_ptr, s_ptr, as_ptr, P, D, num_kb, stride_ap, stride_we, stride_wn, stride_se,
             stride_as, BLOCK_D: tl.constexpr, TILED: tl.constexpr):
    """w2 tile of expert e (int64), pairs `pair` [BLOCK_M], output rows r * BLOCK_D + [0, BLOCK_D):
    (ok [BLOCK_M] real pairs, row_ok [BLOCK_D], w_ptrs, s_ptrs, x_ptrs, zs_ptrs) at K block 0 (no loads)."""
    ok = pair < P
    row = r * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = row < D
    if TILED:  # as in _w13_tile: tile r's K blocks of BLOCK_D rows x 32 words, one after another
        w_off = tl.cast(r, tl.int64) * (num_kb * BLOCK_D * 32) + tl.arange(0, BLOCK_D) * 32
    else:
        w_off = row * stride_wn
    w_ptrs = w_ptr + e * stride_we + w_off[:, None] + tl.arange(0, 32)[None, :]
    s_ptrs = s_ptr + e * stride_se + row
    x_ptrs = a_ptr + tl.where(ok, pair, 0)[None, :] * stride_ap + tl.arange(0, 32)[:, None]
    zs_ptrs = as_ptr + tl.where(ok, pair, 0)[None, :] * stride_as
    return ok, row_ok, w_ptrs, s_ptrs, x_ptrs, zs_ptrs


@triton.jit
def _w2_store(acc, y_ptr, pair, ok, r, D, stride_yp, BLOCK_D: tl.constexpr):
    # acc [BLOCK_D, BLOCK_M] -> y rows of the pairs, output rows r * BLOCK_D + .. (the rows are recomputed
    # from r, not carried: in the persistent loop a carried [BLOCK_D] vector costs registers in every stage)
    row = r * BLOCK_D + tl.arange(0, BLOCK_D)
    tl.store(y_ptr + pair[None, :] * stride_yp + row[:, None], acc, mask=(row < D)[:, None] & ok[None, :])


@triton.jit(do_not_specialize=["nblk"])
def _moe_w2_kernel(
    a_ptr,  # [P, I] from _moe_w13_kernel
    w_ptr, s_ptr,  # w2 GPU layout: int32 [E, D, Ip/8], scale [E, Ip/256, 8, D]
    y_ptr,  # out: fp32 [P, D] unweighted expert output per pair
    pairs_ptr, bexp_ptr,
    as_ptr,  # ZP_MMA: a's group sums from _moe_w13_kernel
    P, I, D, num_kb, nblk,  # nblk = len(bexp) (PERSISTENT only)
    stride_ap, stride_we, stride_wn, stride_se, stride_sb, stride_sk, stride_yp, stride_as,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    DTYPE: tl.constexpr, USE_ASM: tl.constexpr, PREC: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PRESCALE: tl.constexpr, SWAP: tl.constexpr,
    SCALE_TILE: tl.constexpr, K_UNROLL: tl.constexpr, PERSISTENT: tl.constexpr, ZP_MMA: tl.constexpr,
    TILED: tl.constexpr, ACC_CHAINS: tl.constexpr,
):
    if PERSISTENT:  # as in _moe_w13_kernel
        pid = tl.program_id(0)
        n_rt = tl.cdiv(D, BLOCK_D)
        n_tiles = _num_used_blocks(bexp_ptr, nblk) * n_rt
        tile = pid - tl.num_programs(0)
        kb = num_kb - K_UNROLL
        pair = tl.full([BLOCK_M], 0, tl.int32)
        ok, row_ok, w_ptrs, s_ptrs, x_ptrs, zs_ptrs = _w2_tile(0, pair, 0, a_ptr, w_ptr, s_ptr, as_ptr, P, D,
                                                              num_kb, stride_ap, stride_we, stride_wn, stride_se,
                                                              stride_as, BLOCK_D, TILED)
        acc = _swap(tl.zeros([BLOCK_D, BLOCK_M], dtype=tl.float32), SWAP)
        for _ in range(0, tl.cdiv(n_tiles - pid, tl.num_programs(0)) * (num_kb // K_UNROLL)):
            kb = tl.where(kb == num_kb - K_UNROLL, 0, kb + K_UNROLL)
            if kb == 0:
                tile += tl.num_programs(0)
                b = tile // n_rt
                e = tl.load(bexp_ptr + b).to(tl.int64)
                pair = tl.load(pairs_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
                ok, row_ok, w_ptrs, s_ptrs, x_ptrs, zs_ptrs = _w2_tile(
                    e, pair, tile % n_rt, a_ptr, w_ptr, s_ptr, as_ptr, P, D, num_kb, stride_ap, stride_we,
                    stride_wn, stride_se, stride_as, BLOCK_D, TILED)
            acc, x_ptrs, w_ptrs, s_ptrs = _int4_ksteps(
                acc, x_ptrs, ok[None, :], kb, I, w_ptrs, row_ok, s_ptrs, stride_sb, stride_sk, K_UNROLL,
                DTYPE, USE_ASM, PREC, EVEN_K, EVEN_N, PRESCALE, SWAP, SCALE_TILE, ZP_MMA, TILED, ACC_CHAINS)
            if kb == num_kb - K_UNROLL:
                if ZP_MMA:
                    acc = _zp_correction(acc, zs_ptrs, ok[None, :], s_ptrs - num_kb * stride_sb, row_ok, stride_sb,
                                         stride_sk, num_kb, DTYPE, PREC, SWAP)
                _w2_store(_swap(acc, SWAP), y_ptr, pair, ok, tile % n_rt, D, stride_yp, BLOCK_D)
                acc = _swap(tl.zeros([BLOCK_D, BLOCK_M], dtype=tl.float32), SWAP)
    else:
        pid_n = tl.program_id(0)
        pid_b = tl.program_id(1)
        e = tl.load(bexp_ptr + pid_b)
        if e < 0:
            return
        pair = tl.load(pairs_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
        ok, row_ok, w_ptrs, s_ptrs, x_ptrs, zs_ptrs = _w2_tile(
            e.to(tl.int64), pair, pid_n, a_ptr, w_ptr, s_ptr, as_ptr, P, D, num_kb, stride_ap, stride_we,
            stride_wn, stride_se, stride_as, BLOCK_D, TILED)
        acc = tl.zeros([BLOCK_D, BLOCK_M], dtype=tl.float32)
        acc = _int4_block_gemm(acc, x_ptrs, ok[None, :], I, w_ptrs, row_ok, s_ptrs, stride_sb, stride_sk, zs_ptrs,
                               num_kb, DTYPE, USE_ASM, PREC, EVEN_K, EVEN_N, PRESCALE, SWAP, SCALE_TILE, K_UNROLL,
                               ZP_MMA, TILED, ACC_CHAINS)
        _w2_store(acc, y_ptr, pair, ok, pid_n, D, stride_yp, BLOCK_D)


@triton.jit
def _moe_combine_kernel(
    y_ptr,  # fp32 [T*TOPK, D]
    w_ptr,  # [T, TOPK] routing weights
    out_ptr,  # out: [T, D]
    D, stride_yp, stride_ot,
    TOPK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # launched with programmatic dependent launch: wait for the w2 grid (and its writes) first
        gdc_wait()
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOPK):  # slot order 0..TOPK-1: fixed, whatever the batch
        wk = tl.load(w_ptr + t * TOPK + k).to(tl.float32)
        acc += wk * tl.load(y_ptr + (t * TOPK + k) * stride_yp + cols, mask=m, other=0.0)
    tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=m)
