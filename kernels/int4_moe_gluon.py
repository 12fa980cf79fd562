"""Gluon path of `kernels.int4_moe`: its weight layout ("gluon"), made once at load, and its launcher.

Same op, same four launches as the Triton path (`moe_align` into blocks of `block_pairs` pairs, w13 with
SiLU(gate) * up fused, w2 into per-pair fp32 rows, the slot-ordered combine), but the two GEMMs are the Gluon
kernels of `_int4_moe_gluon` (weights from global memory straight into mma.sync, no shared memory). Its
arithmetic is the Triton default's (bf16(q * s) weights, fp32 accumulation, `a` rounded to bf16) in another K
order, so the two paths do not give the same bits; each is batch invariant. GPU only (Gluon has no
interpreter): the CPU tests check the layout against the checkpoint (`gluon_layout_dense`).

"gluon" layout (`repack_int4_moe_for_gluon`), per projection: K padded to a multiple of 512 (zero weights,
zero scales), words int32 [E, N, Kp/8] and scales bf16 [E, N, Kp/32] (the checkpoint's, padded). In each
256-column step of a row, memory word 8q + 4r + c holds the 8 logical columns 64c + 32r + 8q + j (j = 0..7)
of the kernel's K order, which are the step's physical columns

    phys(c, r, q, j) = 64q + 16c + 2r + (j & 1) + 4 * ((j >> 1) & 1) + 8 * (j >> 2)

(so a lane's activations are 16 contiguous columns), column j in nibble position i = j // 2 + 4 * (j % 2)
(k0 k2 k4 k6 k1 k3 k5 k7: `(word >> 4i) & 0x000F000F` is the pair 2i, 2i + 1). A word's columns lie in one
quantisation group, 2q + c // 2 of the step.
"""

from __future__ import annotations

import functools

import torch

from kernels._int4_moe_gluon import HAVE_GLUON, _moe_w2_gluon_kernel, _moe_w13_gluon_kernel
from kernels._moe_frame import routed_moe  # (it imports kernels.int4_moe, which imports this module lazily)
from kernels.int4_pack import PACK_FACTOR, permute_steps

STEP = 256  # K columns per kernel step
K_ALIGN = 512  # the kernels do two steps per loop iteration
WARP_ROWS = 64  # weight rows per program and m16 tile per warp (16 per warp, 4 warps)
BLOCK_PAIRS = (8, 16, 32)  # pairs per expert block: 1, 2 or 4 sub-blocks of 8 (the MMA's N); same bits
DEFAULT_BLOCK_PAIRS = 8  # read at each call
DEFAULT_TILES = (1, 2)  # m16 tiles per warp: w13, w2


@functools.cache
def _step_map() -> tuple[torch.Tensor, torch.Tensor]:
    """(phys [32 words, 8 positions], group [32 words]): the step column held by nibble position i of memory
    word 8q + 4r + c, and that word's group within the step."""
    phys = torch.empty(32, 8, dtype=torch.int64)
    group = torch.empty(32, dtype=torch.int64)
    for q in range(4):
        for r in range(2):
            for c in range(4):
                mw = 8 * q + 4 * r + c
                group[mw] = 2 * q + c // 2
                for j in range(8):
                    pos = j // 2 + 4 * (j % 2)
                    phys[mw, pos] = 64 * q + 16 * c + 2 * r + (j & 1) + 4 * ((j >> 1) & 1) + 8 * (j >> 2)
    return phys, group


def repack_int4_moe_for_gluon(w13_packed, w13_scale, w2_packed, w2_scale):
    """Checkpoint layout -> "gluon" layout (module doc); run once at load."""
    return (*permute_steps(w13_packed, w13_scale, _step_map()[0], K_ALIGN),
            *permute_steps(w2_packed, w2_scale, _step_map()[0], K_ALIGN))


def gluon_layout_dense(words: torch.Tensor, scale: torch.Tensor, in_features: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode one gluon-layout projection back to dense weights [E, N, K] (q * scale), following the kernel's
    reading of it (memory word -> columns, word -> group): the CPU check of the layout."""
    E, N, kw = words.shape
    steps = kw * PACK_FACTOR // STEP
    phys, group = _step_map()
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=words.device)
    q = (((words.long().view(E, N, steps, 32, 1) >> shifts) & 0xF) - 8).to(torch.float32)  # [.., word, pos]
    g = group.to(words.device) + 8 * torch.arange(steps, device=words.device).view(steps, 1)  # [step, word]
    s = scale.to(torch.float32)[:, :, g]  # [E, N, step, word]
    vals = (q * s.unsqueeze(-1)).to(dtype).view(E, N, steps, STEP)
    dense = torch.empty_like(vals)
    dense[..., phys.to(words.device).view(-1)] = vals
    return dense.view(E, N, steps * STEP)[..., :in_features]


def gluon_dense_experts(w13, s13, w2, s2, hidden: int, dtype: torch.dtype = torch.float32):
    """Both projections of a gluon-layout expert stack, dense (w13 [E, 2I, D], w2 [E, D, I]): the CPU path."""
    return gluon_layout_dense(w13, s13, hidden, dtype), gluon_layout_dense(w2, s2, w13.shape[1] // 2, dtype)


def int4_moe_gluon(x, topk_ids, topk_w, w13, s13, w2, s2, out=None, *, block_pairs: int | None = None,
                   tiles: tuple[int, int] = DEFAULT_TILES, experts: range | None = None, reduce_pairs=None):
    """The Gluon path (CUDA, bf16, gluon layout); arguments as `kernels.int4_moe.int4_moe`. Schedule options, all
    with the same bits: `block_pairs` (pairs per expert block, BLOCK_PAIRS, default DEFAULT_BLOCK_PAIRS: a block
    of 16 or 32 is 2 or 4 sub-blocks of 8 that share each step's dequantised weights, empty ones skipped, so an
    expert with many pairs streams its weights once per 32 pairs instead of once per 8) and `tiles` (m16 tiles
    per warp of w13 and of w2, 1 or 2 each: 64 or 128 rows per program)."""
    if not HAVE_GLUON:
        raise RuntimeError("int4_moe_gluon needs Triton with Gluon (3.5 or newer)")
    if not x.is_cuda or x.dtype != torch.bfloat16:
        raise ValueError(f"int4_moe_gluon: bf16 activations on CUDA, got {x.dtype} on {x.device}")
    block_pairs = block_pairs or DEFAULT_BLOCK_PAIRS
    if block_pairs not in BLOCK_PAIRS or len(tiles) != 2 or any(t not in (1, 2) for t in tiles):
        raise ValueError(f"int4_moe_gluon: block_pairs={block_pairs} (one of {BLOCK_PAIRS}), tiles={tiles} "
                         "(1 or 2 each)")
    inter, D = w13.shape[1] // 2, x.shape[1]
    r13, r2 = WARP_ROWS * tiles[0], WARP_ROWS * tiles[1]
    sub = block_pairs // 8

    def w13_gemm(x, a, pairs, bexp, topk, P):
        _moe_w13_gluon_kernel[(-(-inter // r13), bexp.shape[0])](
            x, w13, s13, a, pairs, bexp, P, inter, w13.shape[2] * PACK_FACTOR // STEP,
            x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), a.stride(0),
            TOPK=topk, EVEN=inter % r13 == 0, SUB=sub, RT=tiles[0], num_warps=4)

    def w2_gemm(a, y, pairs, bexp, topk, P):
        _moe_w2_gluon_kernel[(-(-D // r2), bexp.shape[0])](
            a, w2, s2, y, pairs, bexp, P, D, w2.shape[2] * PACK_FACTOR // STEP,
            a.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
            TOPK=topk, EVEN=D % r2 == 0, SUB=sub, RT=tiles[1], num_warps=4)

    return routed_moe("int4_moe_gluon", x, topk_ids, topk_w, w13, s13, w2, s2, out, k_align=K_ALIGN,
                      block_pairs=block_pairs, experts=experts, reduce_pairs=reduce_pairs, w13_gemm=w13_gemm,
                      w2_gemm=w2_gemm)
