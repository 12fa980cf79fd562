"""Counter-based Gumbel noise for seeded sampling (DESIGN 3.2), bit-identical on CPU and GPU.

Owns the noise that `kernels.sampling` adds to warped logits: for a row with (seed, position)
and vocabulary index v,

    words = Philox4x32-10(counter = (v >> 2, position lo, position hi, 0), key = (seed lo, seed hi))
    w     = words[v & 3]                        (one Philox call serves 4 consecutive tokens)
    u     = (2 * (w >> 9) + 1) * 2^-24          (23 random bits; u in (0, 1), exact in fp32)
    g     = -ln(-ln(u))                         (standard Gumbel)

`position` is the absolute position of the token being *predicted*, so every tree node at one
depth (and the AR step that predicts the same position) sees the same noise.

Bit-identity across devices: the hash is integer math; the logarithm is our own (exponent bits +
a fixed degree-8 polynomial evaluated by Horner with fp32 multiplies and adds only, constants
exactly representable in fp32). IEEE-754 fp32 `*`, `+`, `-` and int<->float conversions are
correctly rounded everywhere, so torch on CPU, numpy under TRITON_INTERPRET=1 and the compiled
kernel (launched with `enable_fp_fusion=False`, i.e. no FMA contraction) agree bit for bit.
Library `log`/`exp` (SLEEF, libdevice, numpy) are not used: they differ in the last ulp.
Max error of `log2_f32` vs the true log2 is 6e-8 (absolute), far below anything sampling can see.

Torch references (`philox4x32_10_ref`, `log2_f32_ref`, `gumbel_noise_ref`) hold uint32 values in
int64 tensors; Triton helpers (`philox4x32_10`, `log2_f32`, `gumbel_block`) are reused
by the sampling kernel; `gumbel_noise` is the launcher of a standalone noise kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Philox4x32 constants (Salmon et al., SC'11; Random123)
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF
# compile options of every kernel that must match its torch reference bit for bit: IEEE fp32 mul/add,
# no FMA contraction (Triton's default fuses a * b + c into one rounding)
KERNEL_OPTIONS = {"enable_fp_fusion": False}

LN2 = 0.693147182464599609375  # fp32(ln 2), exactly representable
SQRT2 = 1.41421353816986083984375  # fp32(sqrt 2)
TWO_M24 = 5.9604644775390625e-08  # 2^-24
# log2(1 + f) = f * P(f) on f in [sqrt(1/2) - 1, sqrt(2) - 1]; least squares on Chebyshev nodes,
# coefficients rounded to fp32 (these decimal strings are the exact fp32 values' shortest repr)
LOG2_C = (1.4426950216293335, -0.7213473320007324, 0.48091059923171997, -0.36070483922958374,
          0.2879183292388916, -0.23892034590244293, 0.21566985547542572, -0.20742103457450867,
          0.12614846229553223)

# the same values as compile-time constants for the Triton helpers (jit code reads only constexpr globals)
_M0, _M1, _W0, _W1 = tl.constexpr(PHILOX_M0), tl.constexpr(PHILOX_M1), tl.constexpr(PHILOX_W0), tl.constexpr(PHILOX_W1)
_ROUNDS, _MASK32 = tl.constexpr(PHILOX_ROUNDS), tl.constexpr(MASK32)
_LN2, _SQRT2, _TWO_M24 = tl.constexpr(LN2), tl.constexpr(SQRT2), tl.constexpr(TWO_M24)
_C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7, _C8 = (tl.constexpr(c) for c in LOG2_C)


# --- torch reference ---------------------------------------------------------------------------------
def _mulhilo_ref(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """a: int64 tensor of uint32 values; m: uint32 constant -> (hi, lo) words of the 64-bit a * m.

    The int64 product wraps past 2^63 (two's complement, as torch's integer kernels do on every
    backend); its bit pattern is still the uint64 product, so the shifts and masks recover both
    words. The Random123 known-answer test with all-ones inputs exercises the wrapping case."""
    p = a * m
    return (p >> 32) & MASK32, p & MASK32


def philox4x32_10_ref(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: Tensor, k1: Tensor):
    """Philox4x32-10 on int64 tensors holding uint32 values (broadcastable) -> 4 output words."""
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo_ref(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo_ref(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def log2_f32_ref(x: Tensor) -> Tensor:
    """log2 of positive normal fp32 values with fp32 mul/add only (bit-identical to `log2_f32`)."""
    bits = x.contiguous().view(torch.int32)
    e = (bits >> 23) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)  # mantissa in [1, 2)
    big = m > SQRT2
    m = torch.where(big, m * 0.5, m)  # centre on 1: m in [sqrt(1/2), sqrt(2)]
    e = torch.where(big, e + 1, e)
    f = m - 1.0  # exact (Sterbenz)
    p = torch.full_like(f, LOG2_C[-1])
    for c in LOG2_C[-2::-1]:
        p = p * f + c
    return e.to(torch.float32) + f * p


def gumbel_noise_ref(seed: Tensor, position: Tensor, vocab: int) -> Tensor:
    """seed, position: [R] int64 (>= 0) -> Gumbel noise [R, vocab] fp32 (see module docstring)."""
    dev = seed.device
    seed, position = seed.long()[:, None], position.long()[:, None]  # [R, 1]
    groups = torch.arange((vocab + 3) // 4, device=dev, dtype=torch.int64)[None, :]  # [1, G]
    zero = torch.zeros_like(groups)
    words = philox4x32_10_ref(groups, position & MASK32, position >> 32, zero, seed & MASK32, seed >> 32)
    w = torch.stack(torch.broadcast_tensors(*words), dim=-1).flatten(-2)[:, :vocab]  # [R, vocab], v = 4g + j
    u = ((w >> 9) * 2 + 1).to(torch.float32) * TWO_M24  # exact: odd integer < 2^24 times 2^-24
    e = -(log2_f32_ref(u) * LN2)  # -ln(u) > 0
    return -(log2_f32_ref(e) * LN2)


# --- Triton --------------------------------------------------------------------------------------------
@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """uint32 counters (tensors) and key (scalars) -> 4 uint32 output words, Random123 round order."""
    for _ in tl.static_range(_ROUNDS):
        hi0 = tl.umulhi(c0, _M0)
        lo0 = c0 * _M0
        hi1 = tl.umulhi(c2, _M1)
        lo1 = c2 * _M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + _W0
        k1 = k1 + _W1
    return c0, c1, c2, c3


@triton.jit
def log2_f32(x):
    """Mirror of `log2_f32_ref` (fp32 mul/add only; launch with enable_fp_fusion=False)."""
    bits = x.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > _SQRT2
    m = tl.where(big, m * 0.5, m)
    e = tl.where(big, e + 1, e)
    f = m - 1.0
    p = f * 0.0 + _C8
    p = p * f + _C7
    p = p * f + _C6
    p = p * f + _C5
    p = p * f + _C4
    p = p * f + _C3
    p = p * f + _C2
    p = p * f + _C1
    p = p * f + _C0
    return e.to(tl.float32) + f * p


@triton.jit
def gumbel_block(seed, position, start, BLOCK: tl.constexpr):
    """Noise [BLOCK] fp32 for vocab indices start .. start+BLOCK-1 (start % 4 == 0) of one row.

    seed, position: int64 scalars. One Philox call per 4 consecutive tokens; the 4 words are
    interleaved back into vocab order with join/reshape.
    """
    gl = (start // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)  # [BLOCK/4] counter word 0
    k0 = (seed & _MASK32).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    c1 = gl * 0 + (position & _MASK32).to(tl.uint32)
    c2 = gl * 0 + (position >> 32).to(tl.uint32)
    w0, w1, w2, w3 = philox4x32_10(gl, c1, c2, gl * 0, k0, k1)
    w = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK,))  # [BLOCK], v = 4g + j
    u = ((w >> 9) * 2 + 1).to(tl.int32).to(tl.float32) * _TWO_M24
    e = -(log2_f32(u) * _LN2)
    return -(log2_f32(e) * _LN2)


@triton.jit
def _gumbel_noise_kernel(seed_ptr, pos_ptr, out_ptr, V, stride_om, BLOCK: tl.constexpr):
    """grid (R, cdiv(V, BLOCK)): out[r, v] = noise(seed[r], position[r], v)."""
    r = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    g = gumbel_block(tl.load(seed_ptr + r), tl.load(pos_ptr + r), start, BLOCK)
    offs = start + tl.arange(0, BLOCK)
    tl.store(out_ptr + r.to(tl.int64) * stride_om + offs, g, mask=offs < V)


def check_keys(seed: Tensor, position: Tensor, rows: int | None = None) -> None:
    """seed, position must be [R] int64 on one device; raise ValueError naming the argument."""
    for name, t in (("seed", seed), ("position", position)):
        if t.dim() != 1 or t.dtype != torch.int64:
            raise ValueError(f"{name} must be a 1-D int64 tensor, got {tuple(t.shape)} {t.dtype}")
        if rows is not None and t.shape[0] != rows:
            raise ValueError(f"{name} has {t.shape[0]} rows, expected {rows}")
    if seed.shape != position.shape or seed.device != position.device:
        raise ValueError(f"seed {tuple(seed.shape)} on {seed.device} and position {tuple(position.shape)} "
                         f"on {position.device} must match")


def gumbel_noise(seed: Tensor, position: Tensor, vocab: int, impl: str = "auto", block: int = 1024) -> Tensor:
    """Launcher: [R] seeds and positions -> noise [R, vocab] fp32. impl: auto | triton | torch
    (auto = Triton on CUDA, the reference elsewhere; 'triton' on CPU needs TRITON_INTERPRET=1)."""
    check_keys(seed, position)
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    if impl == "auto":
        impl = "triton" if seed.is_cuda else "torch"
    if impl == "torch":
        return gumbel_noise_ref(seed, position, vocab)
    if impl != "triton":
        raise ValueError(f"impl must be auto, triton or torch, got {impl!r}")
    if block % 4 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 4, got {block}")
    out = torch.empty(seed.shape[0], vocab, dtype=torch.float32, device=seed.device)
    if seed.shape[0]:
        grid = (seed.shape[0], triton.cdiv(vocab, block))
        _gumbel_noise_kernel[grid](seed.contiguous(), position.contiguous(), out, vocab, out.stride(0),
                                   BLOCK=block, **KERNEL_OPTIONS)
    return out
