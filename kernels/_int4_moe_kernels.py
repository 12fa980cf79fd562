"""Triton kernels of `kernels.int4_moe` (w4a16 grouped GEMMs over expert blocks, plus the combine).

Weights are in the GPU layout made by `int4_moe.repack_int4_moe_for_gpu` (K padded to a multiple
of 256; within each 256-column block, word j of a row holds column 32k + j in nibble k, so nibble k
of a [rows, 32]-word tile is exactly quantisation group k of the block):
  packed int32 [E, N, Kp/8]          scale [E, Kp/256, 8, N] (bf16, group-major so loads are rows)

Each program owns one block of BLOCK_M pairs of one expert (see `_moe_align`) and a slice of
output rows, and streams the whole K extent: the GEMM is computed transposed (weights are the
MMA's M side, the <= 16 pairs its N side), per group k: acc += (Q_k @ X_k^T) * scale_k, Q_k the
exact int4 values -8..7. The K loop order is fixed (no split-K), so a pair's result does not depend
on which other pairs share its block or the launch (batch invariance).
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_K = tl.constexpr(256)  # columns per K step: 8 groups of 32, one nibble position each

# Eight bf16 values from each int32 word, exactly (u - 8): pair two words with prmt so that each
# nibble position of both words lands in one bf16x2 register, OR in the exponent of 128.0 (0x4300:
# bf16 128 + u exactly) and subtract 136 with one bf16x2 FMA (Marlin's trick). Output k = nibble k.
_DEQUANT8_PTX = tl.constexpr("""
{
.reg .b32 lo, hi, t, one, bias;
mov.b32 one, 0x3F803F80;
mov.b32 bias, 0xC308C308;
prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
lop3.b32 t, lo, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $0, t, one, bias;
shr.u32 t, lo, 4;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $1, t, one, bias;
shr.u32 t, lo, 8;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $2, t, one, bias;
shr.u32 t, lo, 12;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $3, t, one, bias;
lop3.b32 t, hi, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $4, t, one, bias;
shr.u32 t, hi, 4;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $5, t, one, bias;
shr.u32 t, hi, 8;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $6, t, one, bias;
shr.u32 t, hi, 12;
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 $7, t, one, bias;
}
""")


@triton.jit
def _nibble(w, K: tl.constexpr, DTYPE: tl.constexpr):
    # Portable exact dequant of nibble K: fp32 2^23 + u by bit pattern, minus 2^23 + 8.
    u = (w >> (4 * K)) & 0xF
    return ((u | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0).to(DTYPE)


@triton.jit
def _dequant8(w, DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    if USE_ASM:
        return tl.inline_asm_elementwise(
            _DEQUANT8_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        return (_nibble(w, 0, DTYPE), _nibble(w, 1, DTYPE), _nibble(w, 2, DTYPE), _nibble(w, 3, DTYPE),
                _nibble(w, 4, DTYPE), _nibble(w, 5, DTYPE), _nibble(w, 6, DTYPE), _nibble(w, 7, DTYPE))


@triton.jit
def _xt(x_ptrs, x_ok, c, K, EVEN: tl.constexpr):
    # x^T tile [32, BLOCK_M] of one quantisation group; padding pairs and columns past K read as 0
    # (masked lanes fetch nothing: at T=1 only 1 of the 16 pair columns costs cache bandwidth)
    if EVEN:
        return tl.load(x_ptrs, mask=x_ok, other=0.0)
    else:
        return tl.load(x_ptrs, mask=x_ok & (c < K), other=0.0)


@triton.jit
def _int4_block_gemm(acc, x_ptrs, x_ok, K, w_ptrs, w_ok, s_ptrs, stride_sb, stride_sk, num_kb,
                     DTYPE: tl.constexpr, USE_ASM: tl.constexpr, PREC: tl.constexpr,
                     EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """acc [ROWS, BLOCK_M] += W[rows, :K] @ X^T over the whole K extent, in a fixed order.

    x_ptrs [32, BLOCK_M]: column j of group 0 for each pair's activation row; x_ok [1, BLOCK_M]
    False for padding pairs (never stored). Per 256-column block the 8 group products
    Q_k @ X_k^T are separate MMAs folded into acc in group order with their fp32 scales.
    """
    col = tl.arange(0, 32)[:, None]
    for kb in range(num_kb):
        if EVEN_N:
            w = tl.load(w_ptrs)  # [ROWS, 32] int32: 128 contiguous bytes per row
        else:
            w = tl.load(w_ptrs, mask=w_ok[:, None], other=0)
        q0, q1, q2, q3, q4, q5, q6, q7 = _dequant8(w, DTYPE, USE_ASM)
        c = kb * BLOCK_K + col
        p0 = tl.dot(q0, _xt(x_ptrs, x_ok, c, K, EVEN_K), input_precision=PREC)
        p1 = tl.dot(q1, _xt(x_ptrs + 32, x_ok, c + 32, K, EVEN_K), input_precision=PREC)
        p2 = tl.dot(q2, _xt(x_ptrs + 64, x_ok, c + 64, K, EVEN_K), input_precision=PREC)
        p3 = tl.dot(q3, _xt(x_ptrs + 96, x_ok, c + 96, K, EVEN_K), input_precision=PREC)
        p4 = tl.dot(q4, _xt(x_ptrs + 128, x_ok, c + 128, K, EVEN_K), input_precision=PREC)
        p5 = tl.dot(q5, _xt(x_ptrs + 160, x_ok, c + 160, K, EVEN_K), input_precision=PREC)
        p6 = tl.dot(q6, _xt(x_ptrs + 192, x_ok, c + 192, K, EVEN_K), input_precision=PREC)
        p7 = tl.dot(q7, _xt(x_ptrs + 224, x_ok, c + 224, K, EVEN_K), input_precision=PREC)
        if EVEN_N:  # scales [ROWS] per group, fp32
            s = tl.load(s_ptrs).to(tl.float32)
            acc += p0 * s[:, None]
            s = tl.load(s_ptrs + stride_sk).to(tl.float32)
            acc += p1 * s[:, None]
            s = tl.load(s_ptrs + 2 * stride_sk).to(tl.float32)
            acc += p2 * s[:, None]
            s = tl.load(s_ptrs + 3 * stride_sk).to(tl.float32)
            acc += p3 * s[:, None]
            s = tl.load(s_ptrs + 4 * stride_sk).to(tl.float32)
            acc += p4 * s[:, None]
            s = tl.load(s_ptrs + 5 * stride_sk).to(tl.float32)
            acc += p5 * s[:, None]
            s = tl.load(s_ptrs + 6 * stride_sk).to(tl.float32)
            acc += p6 * s[:, None]
            s = tl.load(s_ptrs + 7 * stride_sk).to(tl.float32)
            acc += p7 * s[:, None]
        else:  # masked rows get scale 0
            acc += p0 * tl.load(s_ptrs, mask=w_ok, other=0.0).to(tl.float32)[:, None]
            acc += p1 * tl.load(s_ptrs + stride_sk, mask=w_ok, other=0.0).to(tl.float32)[:, None]
            acc += p2 * tl.load(s_ptrs + 2 * stride_sk, mask=w_ok, other=0.0).to(tl.float32)[:, None]
            acc += p3 * tl.load(s_ptrs + 3 * stride_sk, mask=w_ok, other=0.0).to(tl.float32)[:, None]
            acc += p4 * tl.load(s_ptrs + 4 * stride_sk, mask=w_ok, other=0.0).to(tl.float32)[:, None]
            acc += p5 * tl.load(s_ptrs + 5 * stride_sk, mask=w_ok, other=0.0).to(tl.float32)[:, None]
            acc += p6 * tl.load(s_ptrs + 6 * stride_sk, mask=w_ok, other=0.0).to(tl.float32)[:, None]
            acc += p7 * tl.load(s_ptrs + 7 * stride_sk, mask=w_ok, other=0.0).to(tl.float32)[:, None]
        w_ptrs += 32
        x_ptrs += BLOCK_K
        s_ptrs += stride_sb
    return acc


@triton.jit
def _moe_w13_kernel(
    x_ptr,  # [T, D] activations
    w_ptr, s_ptr,  # w13 GPU layout: int32 [E, 2I, Dp/8], scale [E, Dp/256, 8, 2I]
    a_ptr,  # out: [P, I] silu(gate) * up per pair, activation dtype
    pairs_ptr, bexp_ptr,  # from _moe_align
    P, D, I, num_kb,
    stride_xt, stride_we, stride_wn, stride_se, stride_sb, stride_sk, stride_ap,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
    DTYPE: tl.constexpr, USE_ASM: tl.constexpr, PREC: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_b)
    if e < 0:
        return
    e = e.to(tl.int64)
    pair = tl.load(pairs_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    ok = pair < P
    r = tl.arange(0, 2 * BLOCK_I)
    n = pid_n * BLOCK_I + r % BLOCK_I  # intermediate column of this row
    row = n + (r // BLOCK_I) * I  # rows 0..BLOCK_I-1: gate, BLOCK_I..: the matching up rows
    row_ok = n < I
    w_ptrs = w_ptr + e * stride_we + row[:, None] * stride_wn + tl.arange(0, 32)[None, :]
    s_ptrs = s_ptr + e * stride_se + row
    x_ptrs = x_ptr + (tl.where(ok, pair, 0) // TOPK)[None, :] * stride_xt + tl.arange(0, 32)[:, None]
    acc = tl.zeros([2 * BLOCK_I, BLOCK_M], dtype=tl.float32)
    acc = _int4_block_gemm(acc, x_ptrs, ok[None, :], D, w_ptrs, row_ok, s_ptrs, stride_sb, stride_sk, num_kb,
                           DTYPE, USE_ASM, PREC, EVEN_K, EVEN_N)
    gate, up = tl.split(tl.permute(tl.reshape(acc, [2, BLOCK_I, BLOCK_M]), (1, 2, 0)))  # [BLOCK_I, BLOCK_M]
    act = gate / (1.0 + tl.exp(-gate)) * up
    n_out = pid_n * BLOCK_I + tl.arange(0, BLOCK_I)
    tl.store(a_ptr + pair[None, :] * stride_ap + n_out[:, None], act.to(a_ptr.dtype.element_ty),
             mask=(n_out < I)[:, None] & ok[None, :])


@triton.jit
def _moe_w2_kernel(
    a_ptr,  # [P, I] from _moe_w13_kernel
    w_ptr, s_ptr,  # w2 GPU layout: int32 [E, D, Ip/8], scale [E, Ip/256, 8, D]
    y_ptr,  # out: fp32 [P, D] unweighted expert output per pair
    pairs_ptr, bexp_ptr,
    P, I, D, num_kb,
    stride_ap, stride_we, stride_wn, stride_se, stride_sb, stride_sk, stride_yp,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    DTYPE: tl.constexpr, USE_ASM: tl.constexpr, PREC: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_b)
    if e < 0:
        return
    e = e.to(tl.int64)
    pair = tl.load(pairs_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = pair < P
    row = pid_n * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = row < D
    w_ptrs = w_ptr + e * stride_we + row[:, None] * stride_wn + tl.arange(0, 32)[None, :]
    s_ptrs = s_ptr + e * stride_se + row
    x_ptrs = a_ptr + tl.where(ok, pair, 0)[None, :] * stride_ap + tl.arange(0, 32)[:, None]
    acc = tl.zeros([BLOCK_D, BLOCK_M], dtype=tl.float32)
    acc = _int4_block_gemm(acc, x_ptrs, ok[None, :], I, w_ptrs, row_ok, s_ptrs, stride_sb, stride_sk, num_kb,
                           DTYPE, USE_ASM, PREC, EVEN_K, EVEN_N)
    tl.store(y_ptr + pair[None, :] * stride_yp + row[:, None], acc, mask=row_ok[:, None] & ok[None, :])


@triton.jit
def _moe_combine_kernel(
    y_ptr,  # fp32 [T*TOPK, D]
    w_ptr,  # [T, TOPK] routing weights
    out_ptr,  # out: [T, D]
    D, stride_yp, stride_ot,
    TOPK: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOPK):  # slot order 0..TOPK-1: fixed, whatever the batch
        wk = tl.load(w_ptr + t * TOPK + k).to(tl.float32)
        acc += wk * tl.load(y_ptr + (t * TOPK + k) * stride_yp + cols, mask=m, other=0.0)
    tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=m)
