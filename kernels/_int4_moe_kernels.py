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
def _group_dot(acc, q, x_ptrs, x_mask, s_ptrs, s_mask, PREC: tl.constexpr):
    # acc [ROWS, BLOCK_M] += (q [ROWS, 32] @ x^T [32, BLOCK_M]) * scale [ROWS]
    xt = tl.load(x_ptrs, mask=x_mask, other=0.0)
    s = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    return acc + tl.dot(q, xt, input_precision=PREC) * s[:, None]


@triton.jit
def _int4_block_gemm(acc, x_ptr, x_row, x_ok, stride_x, K, w_ptrs, w_ok, s_ptrs, stride_sb, stride_sk,
                     num_kb, DTYPE: tl.constexpr, USE_ASM: tl.constexpr, PREC: tl.constexpr):
    """acc [ROWS, BLOCK_M] += W[rows, :K] @ X[x_row, :K]^T over the whole K extent (fixed order)."""
    j = tl.arange(0, 32)
    for kb in range(num_kb):
        w = tl.load(w_ptrs + kb * 32, mask=w_ok[:, None], other=0)  # [ROWS, 32] int32, 16-B rows
        q0, q1, q2, q3, q4, q5, q6, q7 = _dequant8(w, DTYPE, USE_ASM)
        col = kb * BLOCK_K + j  # [32] columns of group 0 of this block
        xp = x_ptr + x_row[None, :] * stride_x + col[:, None]  # [32, BLOCK_M]
        sp = s_ptrs + kb * stride_sb
        acc = _group_dot(acc, q0, xp + 0, x_ok[None, :] & (col + 0 < K)[:, None], sp, w_ok, PREC)
        acc = _group_dot(acc, q1, xp + 32, x_ok[None, :] & (col + 32 < K)[:, None], sp + stride_sk, w_ok, PREC)
        acc = _group_dot(acc, q2, xp + 64, x_ok[None, :] & (col + 64 < K)[:, None], sp + 2 * stride_sk, w_ok,
                         PREC)
        acc = _group_dot(acc, q3, xp + 96, x_ok[None, :] & (col + 96 < K)[:, None], sp + 3 * stride_sk, w_ok,
                         PREC)
        acc = _group_dot(acc, q4, xp + 128, x_ok[None, :] & (col + 128 < K)[:, None], sp + 4 * stride_sk, w_ok,
                         PREC)
        acc = _group_dot(acc, q5, xp + 160, x_ok[None, :] & (col + 160 < K)[:, None], sp + 5 * stride_sk, w_ok,
                         PREC)
        acc = _group_dot(acc, q6, xp + 192, x_ok[None, :] & (col + 192 < K)[:, None], sp + 6 * stride_sk, w_ok,
                         PREC)
        acc = _group_dot(acc, q7, xp + 224, x_ok[None, :] & (col + 224 < K)[:, None], sp + 7 * stride_sk, w_ok,
                         PREC)
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
    acc = tl.zeros([2 * BLOCK_I, BLOCK_M], dtype=tl.float32)
    acc = _int4_block_gemm(acc, x_ptr, pair // TOPK, ok, stride_xt, D, w_ptrs, row_ok, s_ptrs,
                           stride_sb, stride_sk, num_kb, DTYPE, USE_ASM, PREC)
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
    acc = tl.zeros([BLOCK_D, BLOCK_M], dtype=tl.float32)
    acc = _int4_block_gemm(acc, a_ptr, pair, ok, stride_ap, I, w_ptrs, row_ok, s_ptrs,
                           stride_sb, stride_sk, num_kb, DTYPE, USE_ASM, PREC)
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
