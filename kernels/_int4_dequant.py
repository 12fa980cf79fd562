"""Register-level INT4 dequantisation for `_int4_moe_kernels` ("gpu" layout of `int4_moe`).

In a 256-column K block, word j of a weight row holds column 32k + j in nibble k, so nibble k of a
[ROWS, 32]-word tile is quantisation group k; q = nibble - 8, weight = q * scale (bf16, per row and
group; scales group-major [E, Kp/256, 8, N], so one group's scales are N contiguous values).
Two exact paths give identical values: PTX (prmt/lop3 + bf16x2 FMA, Marlin's trick; real GPU, bf16)
and a portable fp32 path (the interpreter, fp16/fp32). `_scales8` loads a block's 8 group scales.

`_dequant8_zp` is the zero-point-free form for `ZP_MMA` kernels: it returns bf16(u * s) of the raw nibble
u = q + 8 in ONE bf16x2 FMA per two weights, (128 + u) * s + (-128 s) rounded once (-128 s is exact: a power
of two times s), instead of an FMA for u - 8 and a multiply by s; the kernel adds the -8 * s * sum(x) of
each group with one extra MMA on the groups' activation sums (`_int4_moe_kernels`).
"""

from __future__ import annotations

import triton
import triton.language as tl


def _dequant8_ptx(scaled: bool, zp: bool = False) -> str:
    """PTX: eight bf16 values per int32 word, exactly (u - 8), optionally times a per-row scale.

    Two words per call: prmt pairs each nibble position of both words in one bf16x2 register, OR
    puts it in the mantissa of 128.0 (0x4300: bf16 128 + u exactly), one bf16x2 FMA subtracts 136
    (Marlin's trick). Output k = nibble k ($0..$7), words in $8, $9; with `scaled`, scale k is the
    bf16x2 $10+k and q * s is rounded once to bf16 (= the fp32 product rounded: it is exact in fp32).
    With `zp` (implies scaled), -128 * scale k is $18+k and output k = bf16(u * s) of the raw nibble u (no
    -8): one FMA (128 + u) * s + (-128 s) from the lop3 result.
    """
    lines = ["{", ".reg .b32 lo, hi, t, one, bias, nz;", "mov.b32 one, 0x3F803F80;", "mov.b32 bias, 0xC308C308;",
             "mov.b32 nz, 0x80008000;", "prmt.b32 lo, $8, $9, 0x5410;", "prmt.b32 hi, $8, $9, 0x7632;"]
    for k in range(8):
        src = "lo" if k < 4 else "hi"
        if k % 4:
            lines.append(f"shr.u32 t, {src}, {4 * (k % 4)};")
        lines.append(f"lop3.b32 t, {'t' if k % 4 else src}, 0x000F000F, 0x43004300, 0xEA;")
        if zp:
            lines.append(f"fma.rn.bf16x2 ${k}, t, ${10 + k}, ${18 + k};")
        elif scaled:
            lines += ["fma.rn.bf16x2 t, t, one, bias;", f"fma.rn.bf16x2 ${k}, t, ${10 + k}, nz;"]
        else:
            lines.append(f"fma.rn.bf16x2 ${k}, t, one, bias;")
    return "\n".join(lines + ["}"])


_DEQUANT8_PTX = tl.constexpr(_dequant8_ptx(False))
_DEQUANT8_SCALED_PTX = tl.constexpr(_dequant8_ptx(True))
_DEQUANT8_ZP_PTX = tl.constexpr(_dequant8_ptx(True, zp=True))


@triton.jit
def _raw_nibble(w, K: tl.constexpr):
    # nibble K as fp32 u in [0, 15] (q + 8), exactly: the bit pattern of 2^23 + u, minus 2^23
    u = (w >> (4 * K)) & 0xF
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _nibble(w, K: tl.constexpr):
    # Portable exact dequant of nibble K to fp32: q = u - 8 (every step exact)
    return _raw_nibble(w, K) - 8.0


@triton.jit
def _dequant8(w, DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """[ROWS, 32] int32 -> eight [ROWS, 32] tensors of exact int4 values (group k = nibble k)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            _DEQUANT8_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        return (_nibble(w, 0).to(DTYPE), _nibble(w, 1).to(DTYPE), _nibble(w, 2).to(DTYPE),
                _nibble(w, 3).to(DTYPE), _nibble(w, 4).to(DTYPE), _nibble(w, 5).to(DTYPE),
                _nibble(w, 6).to(DTYPE), _nibble(w, 7).to(DTYPE))


@triton.jit
def _sc(s_ptrs, w_ok, EVEN_N: tl.constexpr):
    # per-row scale [ROWS] of one group (0 for rows past N)
    if EVEN_N:
        return tl.load(s_ptrs)
    else:
        return tl.load(s_ptrs, mask=w_ok, other=0.0)


@triton.jit
def _scales8(s_ptrs, stride_sk, w_ok, EVEN_N: tl.constexpr, SCALE_TILE: tl.constexpr):
    """The 8 groups' per-row scales [ROWS] of one K block (0 for rows past N).

    Default: 8 loads of ROWS contiguous bf16, 2 bytes per thread, too narrow for cp.async, so the
    software pipeliner leaves them in the loop as plain loads and every K step waits for them.
    SCALE_TILE: one [ROWS, 8] load (16-byte vectors along the rows), which the pipeliner turns into a
    cp.async prefetched with the weights, then split into the 8 groups in registers (same values).
    """
    if SCALE_TILE:
        ptrs = s_ptrs[:, None] + tl.arange(0, 8)[None, :] * stride_sk  # [ROWS, 8], group k = 4a + 2b + c
        if EVEN_N:
            s = tl.load(ptrs)
        else:
            s = tl.load(ptrs, mask=w_ok[:, None], other=0.0)
        s_a0, s_a1 = tl.split(tl.permute(tl.reshape(s, [s.shape[0], 2, 2, 2]), (0, 2, 3, 1)))  # [ROWS, b, c]
        s_00, s_01 = tl.split(tl.permute(s_a0, (0, 2, 1)))  # [ROWS, c]
        s_10, s_11 = tl.split(tl.permute(s_a1, (0, 2, 1)))
        s0, s1 = tl.split(s_00)
        s2, s3 = tl.split(s_01)
        s4, s5 = tl.split(s_10)
        s6, s7 = tl.split(s_11)
        return s0, s1, s2, s3, s4, s5, s6, s7
    else:
        return (_sc(s_ptrs, w_ok, EVEN_N), _sc(s_ptrs + stride_sk, w_ok, EVEN_N),
                _sc(s_ptrs + 2 * stride_sk, w_ok, EVEN_N), _sc(s_ptrs + 3 * stride_sk, w_ok, EVEN_N),
                _sc(s_ptrs + 4 * stride_sk, w_ok, EVEN_N), _sc(s_ptrs + 5 * stride_sk, w_ok, EVEN_N),
                _sc(s_ptrs + 6 * stride_sk, w_ok, EVEN_N), _sc(s_ptrs + 7 * stride_sk, w_ok, EVEN_N))


@triton.jit
def _dequant8_scaled(w, s0, s1, s2, s3, s4, s5, s6, s7, DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """Like _dequant8 but each group k already multiplied by its scale sk [ROWS], rounded once to DTYPE."""
    s0 = s0[:, None]  # [ROWS, 1]
    s1 = s1[:, None]
    s2 = s2[:, None]
    s3 = s3[:, None]
    s4 = s4[:, None]
    s5 = s5[:, None]
    s6 = s6[:, None]
    s7 = s7[:, None]
    if USE_ASM:
        return tl.inline_asm_elementwise(  # scales broadcast along the 32 words of a row
            _DEQUANT8_SCALED_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
            [w, tl.broadcast(s0, w)[0], tl.broadcast(s1, w)[0], tl.broadcast(s2, w)[0], tl.broadcast(s3, w)[0],
             tl.broadcast(s4, w)[0], tl.broadcast(s5, w)[0], tl.broadcast(s6, w)[0], tl.broadcast(s7, w)[0]],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        return (_qs(w, 0, s0, DTYPE), _qs(w, 1, s1, DTYPE), _qs(w, 2, s2, DTYPE), _qs(w, 3, s3, DTYPE),
                _qs(w, 4, s4, DTYPE), _qs(w, 5, s5, DTYPE), _qs(w, 6, s6, DTYPE), _qs(w, 7, s7, DTYPE))


@triton.jit
def _qs(w, K: tl.constexpr, s, DTYPE: tl.constexpr):
    # q * s is exact in fp32 (4-bit x 8-bit mantissas): one rounding, to DTYPE, as in the PTX path
    return (_nibble(w, K) * s.to(tl.float32)).to(DTYPE)


@triton.jit
def _us(w, K: tl.constexpr, s, DTYPE: tl.constexpr):
    # u * s is exact in fp32: one rounding, to DTYPE, as the PTX FMA (128 + u) * s - 128 s
    return (_raw_nibble(w, K) * s.to(tl.float32)).to(DTYPE)


@triton.jit
def _dequant8_zp(w, s0, s1, s2, s3, s4, s5, s6, s7, DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """Eight [ROWS, 32] tensors bf16(u * sk) of the raw nibbles u = q + 8 (the -8 * sk is the caller's)."""
    if USE_ASM:
        # -128 s per row and group once here (exact), not per pair of weights inside the asm
        n0 = (s0 * -128.0).to(s0.dtype)[:, None]
        n1 = (s1 * -128.0).to(s0.dtype)[:, None]
        n2 = (s2 * -128.0).to(s0.dtype)[:, None]
        n3 = (s3 * -128.0).to(s0.dtype)[:, None]
        n4 = (s4 * -128.0).to(s0.dtype)[:, None]
        n5 = (s5 * -128.0).to(s0.dtype)[:, None]
        n6 = (s6 * -128.0).to(s0.dtype)[:, None]
        n7 = (s7 * -128.0).to(s0.dtype)[:, None]
        return tl.inline_asm_elementwise(
            _DEQUANT8_ZP_PTX, "=r,=r,=r,=r,=r,=r,=r,=r" + ",r" * 18,
            [w, tl.broadcast(s0[:, None], w)[0], tl.broadcast(s1[:, None], w)[0], tl.broadcast(s2[:, None], w)[0],
             tl.broadcast(s3[:, None], w)[0], tl.broadcast(s4[:, None], w)[0], tl.broadcast(s5[:, None], w)[0],
             tl.broadcast(s6[:, None], w)[0], tl.broadcast(s7[:, None], w)[0],
             tl.broadcast(n0, w)[0], tl.broadcast(n1, w)[0], tl.broadcast(n2, w)[0], tl.broadcast(n3, w)[0],
             tl.broadcast(n4, w)[0], tl.broadcast(n5, w)[0], tl.broadcast(n6, w)[0], tl.broadcast(n7, w)[0]],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        return (_us(w, 0, s0[:, None], DTYPE), _us(w, 1, s1[:, None], DTYPE), _us(w, 2, s2[:, None], DTYPE),
                _us(w, 3, s3[:, None], DTYPE), _us(w, 4, s4[:, None], DTYPE), _us(w, 5, s5[:, None], DTYPE),
                _us(w, 6, s6[:, None], DTYPE), _us(w, 7, s7[:, None], DTYPE))
