"""Routed-expert MoE with INT4 (compressed-tensors pack-quantized, group 32) weights (DESIGN 2.1, 4).

Weights per layer, stacked over experts at load time (gate and up concatenated on the out axis):
  w13_packed int32 [E, 2I, D/8], w13_scale [E, 2I, D/G]   (rows 0..I-1 = gate, I..2I-1 = up)
  w2_packed  int32 [E, D, I/8],  w2_scale  [E, D, I/G]
y[t] = sum_k topk_w[t, k] * down(silu(gate(x_t)) * up(x_t)) for the experts topk_ids[t, k].
The shared expert is not part of this op.

`moe_dense_ref` is the math on dequantised (or bf16-checkpoint) weights; `int4_moe_ref` composes it
with the reference dequant in `kernels.int4_pack`; both define correctness. The reference works in two
halves: per-pair weighted rows (`moe_pairs_ref`), then the combine (`moe_combine_ref`: each token's k rows
added in ascending expert id).

Expert parallel (`verifier_service.expert_parallel`): a rank holds a contiguous range of experts
(`experts=`); pairs routed elsewhere get -0.0 rows, `reduce_pairs` (an all-reduce over the ranks) fills
them in, and the combine runs unchanged on every rank. Each row is non-zero on exactly one rank and
x + (-0.0) == x, so the reduction is exact in any order: the output is bitwise the single-process one.

`int4_moe` is the launcher: on CUDA it runs the Triton path (kernels in `_int4_moe_kernels`, grouping
in `_moe_align`), elsewhere the reference. GPU path, all on device, no host sync, 4 launches:
  1. `moe_align`: (token, slot) pairs grouped by expert into blocks of 16 (fixed-size outputs),
  2. w13 GEMM per (expert block, 32 intermediate columns): gate and up rows in one tile, SiLU(g)*u
     fused in the epilogue -> a [T*k, I] in the activation dtype,
  3. w2 GEMM per (expert block, 64 output rows) -> y [T*k, D] fp32, one row per (token, slot),
  4. combine: out[t] = sum_s topk_w[t, s] * y[t*k + s] in slot order s = 0..k-1 (no atomics).
Steps 2 and 3 have variants behind launcher options (persistent grid, K unroll, tiled scale loads; see
`int4_moe_triton`), off by default, with the default's bits: benchmarks sweep them.
Every reduction has a fixed order that does not depend on the other tokens of the launch, so a
token's output is bitwise the same alone or inside any batch (DESIGN 3.5; tested on the GPU).
Numerics of the default kernel: weights are dequantised to bf16(q * scale) (one rounding, what a
bf16 dequant gives), products accumulate in fp32, `a` is rounded to the activation dtype between
the two GEMMs (within the bf16 test tolerance, 1.5e-2 relative, at Kimi shapes on the H200).

Weight layouts (`layout=` keyword of the launcher):
  "checkpoint"  the compressed-tensors tensors above; on CUDA they are repacked on every call
                (correct but slow: for tests and one-off use),
  "gpu"         made once at load by `repack_int4_moe_for_gpu`: K (D for w13, I for w2) padded to a
                multiple of 256 with zero weights; in each 256-column block, word j of a row holds
                column 32k + j in nibble k (so nibble k of a 32-word tile is quantisation group k);
                scales group-major: w13_scale [E, Dp/256, 8, 2I], w2_scale [E, Ip/256, 8, D].
                `unrepack_int4_moe` inverts it bit for bit.
  "gluon"       made once at load by `kernels.int4_moe_gluon.repack_int4_moe_for_gluon`: the layout of the Gluon
                mma.sync kernels (other bits than the Triton path's; opt-in, see that module), decoded on CPU.
  "wgmma"       made once at load by `kernels.int4_moe_wgmma.repack_int4_moe_for_wgmma`: the layout of the sm_90
                warpgroup-MMA kernels (other bits again), decoded on CPU.
  "wgmma_steps" made once at load by `kernels.int4_moe_wgmma.repack_int4_moe_for_wgmma_steps`: "wgmma"'s words
                and scales, each expert's in step-major order (same shapes, kernels and bits as "wgmma"; the
                model's default on sm_90, faster reads).
`tile_int4_moe_weights` regroups the "gpu" words per kernel tile (5-D, same bits; a benchmark option of
`int4_moe_triton`, not a `layout=` of `int4_moe`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._int4_moe_kernels import (
    ZP_COLS,
    _group_sums_kernel,
    _moe_combine_kernel,
    _moe_w2_kernel,
    _moe_w13_kernel,
)
from kernels._moe_align import moe_align
from kernels.int4_pack import PACK_FACTOR, dequantize_int4


def _local_ids(topk_ids: torch.Tensor, experts: range | None, n_local: int) -> torch.Tensor:
    """Global expert ids -> indices into the held stack; experts not held -> n_local (skipped)."""
    if experts is None:
        return topk_ids
    local = topk_ids - experts.start
    return torch.where((local >= 0) & (local < n_local), local, n_local)


def _pair_buffer(P: int, D: int, dtype: torch.dtype, device, partial: bool) -> torch.Tensor:
    """[P, D] per-pair rows. With a subset of the experts, pairs of other experts hold -0.0: the additive
    identity of IEEE addition (x + -0.0 == x for every x, +0.0 included), so summing the ranks' buffers,
    whose supports are disjoint, reproduces every row bit for bit in any reduction order."""
    if partial:
        return torch.full((P, D), -0.0, dtype=dtype, device=device)
    return torch.empty(P, D, dtype=dtype, device=device)


def moe_pairs_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, n_local: int, expert,
                  experts: range | None = None) -> torch.Tensor:
    """The reference math up to the combine: per (token, slot) pair p = t * k + s, the weighted expert output
    topk_w[t, s] * E(x_t) [T*k, D] (acc dtype). `expert(i) -> (w13 [2I, D], w2 [D, I])` of the i-th held expert
    is asked only for experts with tokens; `experts` = global ids held (None: all, ids index the stack);
    pairs routed to experts not held are -0.0 (`_pair_buffer`)."""
    T, D = x.shape
    k = topk_ids.shape[1]
    acc = torch.promote_types(x.dtype, torch.float32)
    local = _local_ids(topk_ids, experts, n_local).reshape(-1)
    pairs = _pair_buffer(T * k, D, acc, x.device, experts is not None)
    order = torch.argsort(local, stable=True)  # group (token, slot) pairs by expert, pair order inside
    counts = torch.bincount(local, minlength=n_local + 1).tolist()
    if experts is None and len(counts) > n_local + 1:
        raise ValueError(f"moe: expert id {len(counts) - 1} is outside the {n_local} experts")
    start = 0
    for e, c in enumerate(counts[:n_local]):
        if c == 0:
            continue
        pair = order[start : start + c]
        start += c
        w13_e, w2_e = expert(e)
        inter = w2_e.shape[-1]
        h = x[pair // k].to(acc) @ w13_e.to(acc).T  # [c, 2I]
        a = F.silu(h[:, :inter]) * h[:, inter:]
        pairs[pair] = (a @ w2_e.to(acc).T) * topk_w.reshape(-1)[pair].to(acc)[:, None]  # [c, D]
    return pairs


def moe_combine_ref(pairs: torch.Tensor, topk_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum of token t's k weighted pair rows, added one by one in ascending global expert id
    (starting from +0.0), then cast to `dtype`. A fixed order that depends only on the token's own routing."""
    T, k = topk_ids.shape
    rows = pairs.view(T, k, -1).gather(1, topk_ids.argsort(dim=1)[..., None].expand(T, k, pairs.shape[-1]))
    out = torch.zeros(T, pairs.shape[-1], dtype=pairs.dtype, device=pairs.device)
    for s in range(k):
        out += rows[:, s]
    return out.to(dtype)


def _moe_loop(x, topk_ids, topk_w, n_local: int, expert, experts: range | None = None,
              reduce_pairs=None) -> torch.Tensor:
    """moe_pairs_ref, then `reduce_pairs(pairs)` (in place: expert parallel sums the ranks' rows), combine."""
    pairs = moe_pairs_ref(x, topk_ids, topk_w, n_local, expert, experts)
    if reduce_pairs is not None:
        reduce_pairs(pairs)
    return moe_combine_ref(pairs, topk_ids, x.dtype)


def moe_dense_ref(
    x: torch.Tensor,  # [T, D]
    topk_ids: torch.Tensor,  # [T, k] int global expert ids
    topk_w: torch.Tensor,  # [T, k] fp32 routing weights (already normalised and scaled)
    w13: torch.Tensor,  # [E_held, 2I, D]
    w2: torch.Tensor,  # [E_held, D, I]
    experts: range | None = None,  # global ids of the held experts (None: all of them)
    reduce_pairs=None,  # in-place reduction of the [T*k, D] pair rows before the combine (expert parallel)
) -> torch.Tensor:
    return _moe_loop(x, topk_ids, topk_w, w13.shape[0], lambda e: (w13[e], w2[e]), experts, reduce_pairs)


def int4_moe_ref(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, experts=None, reduce_pairs=None):
    """moe_dense_ref on the reference dequant; only the experts that received tokens are dequantised."""
    acc = torch.promote_types(x.dtype, torch.float32)
    return _moe_loop(x, topk_ids, topk_w, w13_packed.shape[0],
                     lambda e: (dequantize_int4(w13_packed[e], w13_scale[e], acc),
                                dequantize_int4(w2_packed[e], w2_scale[e], acc)), experts, reduce_pairs)


_BLOCK_K = 256  # K block of the GPU layout: 8 groups of 32 columns
# Pairs per expert block (the MMA's M side with `_SWAP`). Part of the schedule, not of the arithmetic: a
# pair's output has the same bits in a block of 16, 32 or 64 (tested), so it is a launcher option. Each block
# streams its expert's weights once; bigger blocks read an expert with many pairs fewer times but cost
# compute lanes, registers and CTAs per SM (sm_90, Triton 3.6: 16 -> 96 registers, 386 instructions per K
# step; 32 -> 122, 432; 64 -> 156-168 and 149 KB of shared memory). Measured on the H200 (2026-11-30,
# bench/results/int4_moe_block_m.jsonl), 32 lost at every T with uniform routing, also at T = 264 / 528
# (3.51 -> 4.44 / 4.00 -> 4.69 ms: second blocks of an expert mostly hit L2), and tied in the verify step's
# correlated routing (16 sessions x 33 nodes: 5.13 vs 5.07 ms/layer; x 9 nodes: 2.13 vs 2.41): 16 stays.
BLOCK_M_CHOICES = (16, 32, 64)
DEFAULT_BLOCK_M = 16

_BLOCK_I = 32  # w13: intermediate columns per program (32 gate + 32 up weight rows)
_BLOCK_D = 64  # w2: output rows per program
_USE_ASM = True  # bf16 on CUDA: PTX prmt/lop3 dequant (exact, same values as the portable path)
_SWAP = True  # pairs on the MMA's M side (mma.sync, no wgmma waits) vs N side (wgmma, weights as A)
_PRESCALE = True  # dequantise to bf16(q * scale) and chain the 8 group MMAs (vs exact q, fp32 scale per group)
# a K step's 8 group scales as one [rows, 8] cp.async load, prefetched with the weights (same bits); H200:
# T=1 0.102 -> 0.089 ms, T=9 0.656 -> 0.605, T=33 1.856 -> 1.724 (bench/results/int4_moe_same_bits.jsonl)
_SCALE_TILE = True
# the zero point out of the dequant (`_int4_moe_kernels` doc, ZP_MMA): one bf16x2 FMA per two weights instead of
# two, plus MMAs on precomputed group sums after the K loop (one more launch, for x's sums). Other bits. Read at
# each call (benchmarks flip it).
DEFAULT_ZP_MMA = False
# independent MMA accumulator chains per K step (`_int4_moe_kernels` doc, ACC_CHAINS; other bits). Read at each call.
DEFAULT_ACC_CHAINS = 1


def _repack_proj(packed: torch.Tensor, scale: torch.Tensor):
    """One projection stack: int32 [E, N, K/8] + scale [E, N, K/32] -> GPU layout (module doc)."""
    E, N, k8 = packed.shape
    K = k8 * PACK_FACTOR
    kp = -(-K // _BLOCK_K) * _BLOCK_K
    out_w = torch.empty(E, N, kp // PACK_FACTOR, dtype=torch.int32, device=packed.device)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    for e in range(E):  # per expert: bounded temporaries
        u = ((packed[e].long().unsqueeze(-1) >> shifts) & 0xF).flatten(-2)  # [N, K], column order
        u = F.pad(u, (0, kp - K), value=8)  # q = 0 in the padding
        u = u.view(N, kp // _BLOCK_K, 8, 32)  # [N, block, group k, j]: column 32k + j of the block
        words = (u << shifts.view(1, 1, 8, 1)).sum(2)  # nibble k of word j = column 32k + j
        out_w[e] = torch.where(words >= 2**31, words - 2**32, words).view(N, -1).to(torch.int32)
    s = F.pad(scale, (0, kp // 32 - scale.shape[-1]))  # zero scales in the padding
    out_s = s.view(E, N, kp // _BLOCK_K, 8).permute(0, 2, 3, 1).contiguous()  # [E, Kp/256, 8, N]
    return out_w, out_s


def _unrepack_proj(packed: torch.Tensor, scale: torch.Tensor, K: int):
    E, N, _ = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=packed.device)
    u = (packed.long().view(E, N, -1, 1, 32) >> shifts.view(1, 1, 1, 8, 1)) & 0xF  # [E,N,blk,k,j]
    u = u.flatten(2)[..., :K].view(E, N, K // PACK_FACTOR, PACK_FACTOR)
    words = (u << shifts).sum(-1)
    w = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    s = scale.permute(0, 3, 1, 2).reshape(E, N, -1)[..., : K // 32].contiguous()
    return w, s


def repack_int4_moe_for_gpu(w13_packed, w13_scale, w2_packed, w2_scale):
    """Checkpoint layout -> "gpu" layout (module doc); run once at load."""
    return (*_repack_proj(w13_packed, w13_scale), *_repack_proj(w2_packed, w2_scale))


def tile_int4_moe_weights(w13, s13, w2, s2, block_i: int = _BLOCK_I, block_d: int = _BLOCK_D):
    """"gpu" layout -> the same words regrouped per kernel tile (scales unchanged), run once at load:
      w13 int32 [E, cdiv(I, block_i), Dp/256, 2 * block_i, 32]  (tile r, K block, its gate rows then up rows)
      w2  int32 [E, cdiv(D, block_d), Ip/256, block_d, 32]
    so a program of the GEMMs (block_i / block_d rows) reads one contiguous run per K block, its blocks one after
    another. Rows past I / D are zero words (never stored). The launcher reads the tile sizes off the shapes."""
    E, two_i, k8 = w13.shape
    inter, D = two_i // 2, w2.shape[1]
    ni, nd = -(-inter // block_i), -(-D // block_d)
    g = w13.view(E, 2, inter, k8 // 32, 32)
    g = F.pad(g, (0, 0, 0, 0, 0, ni * block_i - inter)).view(E, 2, ni, block_i, k8 // 32, 32)
    w13t = g.permute(0, 2, 4, 1, 3, 5).reshape(E, ni, k8 // 32, 2 * block_i, 32).contiguous()
    d = F.pad(w2.view(E, D, -1, 32), (0, 0, 0, 0, 0, nd * block_d - D)).view(E, nd, block_d, -1, 32)
    w2t = d.permute(0, 1, 3, 2, 4).contiguous()
    return w13t, s13, w2t, s2


def unrepack_int4_moe(w13_packed, w13_scale, w2_packed, w2_scale, hidden: int):
    """Inverse of `repack_int4_moe_for_gpu` (needs the true hidden size D; I = w13 rows / 2)."""
    inter = w13_packed.shape[1] // 2
    return (*_unrepack_proj(w13_packed, w13_scale, hidden), *_unrepack_proj(w2_packed, w2_scale, inter))


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


_RESIDENT: dict = {}  # (kernel name, device index, sorted launch options) -> default persistent grid size


def _resident_programs(kernel, args, options: dict, device: torch.device) -> int:
    """Default persistent grid: SMs x CTAs of `kernel` that fit on one SM by registers and shared memory of
    the compiled kernel (the occupancy rule of Triton's fused-softmax tutorial); 4 programs off CUDA."""
    if device.type != "cuda":
        return 4
    key = (kernel.fn.__name__, device.index, tuple(sorted(options.items())))
    if key not in _RESIDENT:
        compiled = kernel.warmup(*args, grid=(1,), **options)
        compiled._init_handles()
        props = triton.runtime.driver.active.utils.get_device_properties(device.index)
        by_regs = props["max_num_regs"] // max(1, compiled.n_regs * 32 * options["num_warps"])
        by_smem = props["max_shared_mem"] // max(1, compiled.metadata.shared)
        _RESIDENT[key] = props["multiprocessor_count"] * max(1, min(by_regs, by_smem))
    return _RESIDENT[key]


def _launch(kernel, row_tiles: int, nblk: int, persistent: bool, num_programs: int | None, args, options: dict):
    """One program per (row tile, block), blocks of expert -1 exit at once; or persistent: a 1-D grid of
    min(tiles, programs) programs that walk the used blocks' tiles (grid bound: unused blocks counted)."""
    if not persistent:
        kernel[(row_tiles, nblk)](*args, **options)
        return
    programs = num_programs or _resident_programs(kernel, args, options, args[0].device)
    kernel[(min(row_tiles * nblk, programs),)](*args, **options)


def _zp_sums(x: torch.Tensor, P: int, kb13: int, kb2: int, inter: int, block_i: int, zp_mma: bool):
    """ZP_MMA's group-sum buffers: x's (filled here, one launch) and a's (filled by the w13 epilogue; zeroed
    first only where the w13 tiles do not reach I's padded width); without zp_mma, x twice (never read)."""
    if not zp_mma:
        return x, x
    T, D = x.shape
    groups = kb13 * 8
    xs = torch.empty(T, kb13 * ZP_COLS, dtype=x.dtype, device=x.device)
    block_g = min(256, triton.next_power_of_2(groups))
    _group_sums_kernel[(T, triton.cdiv(groups, block_g))](x, xs, D, groups, x.stride(0), xs.stride(0),
                                                          BLOCK_G=block_g, num_warps=4)
    covered = triton.cdiv(inter, block_i) * block_i >= kb2 * _BLOCK_K
    a_sums = (torch.empty if covered else torch.zeros)(P, kb2 * ZP_COLS, dtype=x.dtype, device=x.device)
    return xs, a_sums


def _int4_moe_triton(x, topk_ids, topk_w, w13, s13, w2, s2, out=None, *, experts: range | None = None,
                     reduce_pairs=None, block_i: int = _BLOCK_I, block_d: int = _BLOCK_D, num_warps: int = 4,
                     num_stages: int = 3, use_asm: bool = _USE_ASM, prescale: bool = _PRESCALE, swap: bool = _SWAP,
                     scale_tile: bool = _SCALE_TILE, k_unroll: int = 1, persistent: bool | str = False,
                     num_programs: int | None = None, maxnreg: int | None = None, block_m: int | None = None,
                     zp_mma: bool | None = None, acc_chains: int | None = None):
    T, D = x.shape
    topk = topk_ids.shape[1]
    tiled = w13.dim() == 5  # tile_int4_moe_weights: the tile sizes are the layout's
    if tiled:
        if (block_i, block_d) not in ((_BLOCK_I, _BLOCK_D), (w13.shape[3] // 2, w2.shape[3])):
            raise ValueError(f"int4_moe: tiled weights are for block_i={w13.shape[3] // 2}, block_d={w2.shape[3]}")
        block_i, block_d = w13.shape[3] // 2, w2.shape[3]
        E, inter = w13.shape[0], s13.shape[-1] // 2
        kb13, kb2 = w13.shape[2], w2.shape[2]
    else:
        E, two_i, _ = w13.shape
        inter = two_i // 2
        kb13, kb2 = w13.shape[2] // 32, w2.shape[2] // 32  # 256-column K blocks
    P = T * topk
    if persistent not in (False, True, "w13", "w2"):
        raise ValueError(f"int4_moe: persistent={persistent!r} (False, True, 'w13' or 'w2')")
    block_m = block_m or DEFAULT_BLOCK_M
    zp_mma = DEFAULT_ZP_MMA if zp_mma is None else zp_mma
    acc_chains = DEFAULT_ACC_CHAINS if acc_chains is None else acc_chains
    if acc_chains not in (1, 2, 4) or (acc_chains > 1 and not prescale):
        raise ValueError(f"int4_moe: acc_chains={acc_chains} (1, 2 or 4; more than 1 needs prescale)")
    if block_m not in BLOCK_M_CHOICES:
        raise ValueError(f"int4_moe: block_m={block_m} (one of {BLOCK_M_CHOICES})")
    pers13, pers2 = persistent in (True, "w13"), persistent in (True, "w2")
    if k_unroll < 1 or (pers13 and kb13 % k_unroll) or (pers2 and kb2 % k_unroll):
        raise ValueError(f"int4_moe: k_unroll={k_unroll} (persistent: must divide the K blocks, {kb13} / {kb2})")
    if num_programs is not None and (not persistent or num_programs < 1):
        raise ValueError(f"int4_moe: num_programs={num_programs} needs persistent and >= 1")
    if zp_mma and (not prescale or block_i % 32):
        raise ValueError(f"int4_moe: zp_mma needs prescale and block_i a multiple of 32 (got prescale={prescale}, "
                         f"block_i={block_i})")
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError("int4_moe: out must match x")
    if T == 0:
        return out
    x = x.contiguous()
    sorted_pairs, bexp = moe_align(_local_ids(topk_ids, experts, E), E, block_m)  # experts not held: skipped
    nblk = bexp.shape[0]
    common = dict(BLOCK_M=block_m, DTYPE=_TL_DTYPE[x.dtype], PREC="ieee" if x.dtype == torch.float32 else "tf32",
                  USE_ASM=use_asm and x.dtype == torch.bfloat16 and x.is_cuda,  # PTX: real GPU only
                  PRESCALE=prescale, SWAP=swap, SCALE_TILE=scale_tile, K_UNROLL=k_unroll, ZP_MMA=zp_mma, TILED=tiled,
                  ACC_CHAINS=acc_chains,
                  num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:
        common["maxnreg"] = maxnreg  # ptxas register cap per thread (more CTAs per SM, or spills)
    a = torch.empty(P, inter, dtype=x.dtype, device=x.device)  # silu(gate) * up per pair
    xs, a_sums = _zp_sums(x, P, kb13, kb2, inter, block_i, zp_mma)
    _launch(_moe_w13_kernel, triton.cdiv(inter, block_i), nblk, pers13, num_programs, (
        x, w13, s13, a, sorted_pairs, bexp, xs, a_sums, P, D, inter, kb13, nblk,
        x.stride(0), w13.stride(0), w13.stride(-2), s13.stride(0), s13.stride(1), s13.stride(2), a.stride(0),
        xs.stride(0), a_sums.stride(0)),
        dict(TOPK=topk, BLOCK_I=block_i, EVEN_K=D % _BLOCK_K == 0, EVEN_N=inter % block_i == 0, PERSISTENT=pers13,
             **common))
    y = _pair_buffer(P, D, torch.float32, x.device, experts is not None)  # unweighted expert output per pair
    _launch(_moe_w2_kernel, triton.cdiv(D, block_d), nblk, pers2, num_programs, (
        a, w2, s2, y, sorted_pairs, bexp, a_sums, P, inter, D, kb2, nblk,
        a.stride(0), w2.stride(0), w2.stride(-2), s2.stride(0), s2.stride(1), s2.stride(2), y.stride(0),
        a_sums.stride(0)),
        dict(BLOCK_D=block_d, EVEN_K=inter % _BLOCK_K == 0, EVEN_N=D % block_d == 0, PERSISTENT=pers2, **common))
    if reduce_pairs is not None:
        reduce_pairs(y)  # expert parallel: every rank now holds every pair's row, bit for bit
    _moe_combine_kernel[(T, triton.cdiv(D, 1024))](
        y, topk_w.contiguous(), out, D, y.stride(0), out.stride(0), TOPK=topk, BLOCK=1024, num_warps=4)
    return out


def int4_moe(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, *, layout: str = "checkpoint",
             experts: range | None = None, reduce_pairs=None):
    """Launcher: checks shapes; Triton kernels on CUDA, the reference elsewhere.

    x [T, D]; topk_ids [T, k] int (ids in [0, E)); topk_w [T, k] fp32; weights in `layout` (module doc).
    Expert parallel (module doc): `experts` = the global ids of the stacked experts (a contiguous range;
    None = all, ids index the stack); `reduce_pairs(rows)` sums the ranks' per-pair rows in place before the
    combine (an all-reduce: exact, since each row is non-zero on one rank only).
    """
    if experts is not None and len(experts) != w13_packed.shape[0]:
        raise ValueError(f"int4_moe: {len(experts)} expert ids for {w13_packed.shape[0]} stacked experts")
    if layout not in ("checkpoint", "gpu", "gluon", "wgmma", "wgmma_steps"):
        raise ValueError(f"int4_moe: unknown layout {layout!r}")
    if layout in ("gluon", "wgmma", "wgmma_steps"):  # kernels/int4_moe_{gluon,wgmma}.py on CUDA, decoded elsewhere
        if layout == "gluon":
            from kernels.int4_moe_gluon import gluon_dense_experts as dense  # imports us
            from kernels.int4_moe_gluon import int4_moe_gluon as run
        else:
            from kernels import int4_moe_wgmma as wg
            dense = wg.wgmma_dense_experts if layout == "wgmma" else wg.wgmma_steps_dense_experts
            run = functools.partial(wg.int4_moe_wgmma, layout=layout)
        if x.is_cuda:
            return run(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, experts=experts,
                       reduce_pairs=reduce_pairs)
        w13, w2 = dense(w13_packed, w13_scale, w2_packed, w2_scale, x.shape[1],
                        torch.promote_types(x.dtype, torch.float32))
        return moe_dense_ref(x, topk_ids, topk_w, w13, w2, experts, reduce_pairs)
    T, D = x.shape
    if w13_packed.dim() != 3 or w2_packed.dim() != 3:
        raise ValueError(f"int4_moe: packed weights must be 3-D [E, N, K/8] in the {layout} layout, got "
                         f"{tuple(w13_packed.shape)} / {tuple(w2_packed.shape)} (tiled weights: int4_moe_triton)")
    E, two_i, kw = w13_packed.shape
    kp = -(-D // _BLOCK_K) * _BLOCK_K if layout == "gpu" else D
    ip = -(-(two_i // 2) // _BLOCK_K) * _BLOCK_K if layout == "gpu" else two_i // 2
    if kw * 8 != kp or w2_packed.shape[:2] != (E, D) or w2_packed.shape[2] * 8 != ip or two_i % 2:
        raise ValueError(f"int4_moe: x {tuple(x.shape)}, w13 {tuple(w13_packed.shape)}, "
                         f"w2 {tuple(w2_packed.shape)} do not agree ({layout} layout)")
    if topk_ids.shape != topk_w.shape or topk_ids.shape[0] != T:
        raise ValueError("int4_moe: topk_ids/topk_w must both be [T, k]")
    if w13_packed.dtype != torch.int32 or w2_packed.dtype != torch.int32:
        raise ValueError("int4_moe: packed weights must be int32")
    if x.is_cuda:
        if layout == "checkpoint":
            w13_packed, w13_scale, w2_packed, w2_scale = repack_int4_moe_for_gpu(
                w13_packed, w13_scale, w2_packed, w2_scale)
        if x.dtype not in _TL_DTYPE:
            raise ValueError(f"int4_moe: unsupported activation dtype {x.dtype}")
        return _int4_moe_triton(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, experts=experts,
                                reduce_pairs=reduce_pairs)
    if layout == "gpu":
        w13_packed, w13_scale, w2_packed, w2_scale = unrepack_int4_moe(
            w13_packed, w13_scale, w2_packed, w2_scale, D)
    return int4_moe_ref(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, experts, reduce_pairs)


def int4_moe_triton(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, out=None, **config):
    """The Triton path on any device (tests call it on CPU under TRITON_INTERPRET=1); "gpu" layout.

    `out` ([T, D], x's dtype, optional) is written in place (tests poison it first); `config`
    overrides the tile sizes (block_i, block_d), num_warps, num_stages, use_asm, prescale, swap (benchmarks),
    or passes `experts` / `reduce_pairs` (expert parallel, see `int4_moe`). Options with the same bits as
    without them (`_int4_moe_kernels` doc): scale_tile (bool), k_unroll (K blocks per loop iteration),
    persistent (True, or "w13" / "w2" for one GEMM only; k_unroll must divide its K blocks, 28 / 8 at
    Kimi shapes), num_programs (persistent grid size; default SMs x the CTAs of the compiled kernel that
    fit on an SM, 4 off CUDA), maxnreg (ptxas register cap, e.g. 128 to fit 4 CTAs of 4 warps per SM),
    block_m (pairs per expert block, one of BLOCK_M_CHOICES; default `DEFAULT_BLOCK_M`); weights from
    `tile_int4_moe_weights` (5-D: their tile sizes replace block_i / block_d). Other arithmetic (other bits):
    zp_mma (the zero point by an MMA on group sums, see `_int4_moe_kernels`; needs prescale, block_i % 32 == 0),
    acc_chains (1, 2 or 4 independent MMA accumulator chains per K step; more than 1 needs prescale); defaults
    `DEFAULT_ZP_MMA` / `DEFAULT_ACC_CHAINS`, read at each call."""
    return _int4_moe_triton(x, topk_ids, topk_w, w13_packed, w13_scale, w2_packed, w2_scale, out, **config)
