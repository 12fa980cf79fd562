"""Device-side grouping of (token, slot) pairs by expert for the INT4 MoE kernels (no host sync).

Pair p = t * topk + k is token t's k-th routed expert `topk_ids[t, k]`. The GEMM kernels work on
blocks of BLOCK_M pairs that share one expert, so each expert's pairs are laid out contiguously,
padded up to a multiple of BLOCK_M (vLLM's `moe_align_block_size` idea, with fixed-size outputs
so nothing depends on a host-side count and the step stays CUDA-graph capturable):

  sorted_pairs  int32 [max_blocks * BLOCK_M]  pair ids, grouped by expert, ascending pair id within
                                              an expert; padding slots hold P (= T * topk)
  block_expert  int32 [max_blocks]            expert of each block, -1 for unused blocks

Ids equal to num_experts are skipped (no slot, no block): expert parallelism maps the pairs of experts
another rank holds there.

max_blocks = cdiv(P, BLOCK_M) + min(E, P) bounds sum_e cdiv(count_e, BLOCK_M). Only weight rows
are streamed per block, so padding costs compute lanes, never weight bytes.

Two implementations produce identical outputs: a single-program Triton kernel (a sort of the keys
`expert * P_PAD + pair`, a segmented scan for the rank inside the expert, a cumsum for the block
index) used for P <= FAST_MAX_PAIRS (the decode/verify regime: one launch), and a torch version
made of sync-free device ops for larger P (prefill) and as the test oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FAST_MAX_PAIRS = 4096  # 512 tokens x top-8: the single-program sort stays cheap up to here


def max_blocks_for(num_pairs: int, num_experts: int, block_m: int) -> int:
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


@triton.jit
def _run_length(e1, c1, e2, c2):
    # Segmented count over a sorted sequence: (last expert, length of its trailing run).
    return e2, c2 + tl.where(e1 == e2, c1, 0)


@triton.jit
def _moe_align_kernel(
    ids_ptr,  # [P] int topk_ids flattened (pair order)
    pairs_ptr,  # out: int32 [MAXB * BLOCK_M]
    bexp_ptr,  # out: int32 [MAXB]
    P, E, MAXB,
    BLOCK_M: tl.constexpr, P_PAD: tl.constexpr, FILL: tl.constexpr,
):
    offs = tl.arange(0, P_PAD)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=E).to(tl.int32)
    key = tl.sort(ids * P_PAD + offs)  # unique keys: expert-major, pair id breaks ties
    e = key // P_PAD
    pair = key % P_PAD
    valid = e < E
    _, run = tl.associative_scan((e, tl.full([P_PAD], 1, tl.int32)), 0, _run_length)
    rank = run - 1  # position of the pair inside its expert's group
    first = valid & (rank % BLOCK_M == 0)  # pair opens a new block
    block = tl.cumsum(first.to(tl.int32), 0) - 1
    pos = block * BLOCK_M + rank % BLOCK_M
    # Fill with sentinels, then scatter; one program, so a barrier orders the two.
    for start in range(0, MAXB * BLOCK_M, FILL):
        f = start + tl.arange(0, FILL)
        tl.store(pairs_ptr + f, tl.full([FILL], 0, tl.int32) + P, mask=f < MAXB * BLOCK_M)
    for start in range(0, MAXB, FILL):
        f = start + tl.arange(0, FILL)
        tl.store(bexp_ptr + f, tl.full([FILL], -1, tl.int32), mask=f < MAXB)
    tl.debug_barrier()
    tl.store(pairs_ptr + pos, pair, mask=valid)
    tl.store(bexp_ptr + block, e, mask=first)


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sync-free torch version (same outputs as the kernel): used for large P and as the oracle."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long().clamp(max=num_experts)  # id num_experts: not held here, skipped
    P = flat.numel()
    maxb = max_blocks_for(P, num_experts, block_m)
    order = torch.argsort(flat * P + torch.arange(P, device=dev))  # unique keys: stable by pair id
    e_sorted = flat[order]
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).index_add_(
        0, flat, torch.ones_like(flat))
    counts[num_experts:].zero_()  # skipped pairs open no block (in place: `t[i] = 0` copies from the host)
    nblk = (counts + block_m - 1) // block_m
    blk_start = torch.cumsum(nblk, 0) - nblk
    grp_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(P, device=dev) - grp_start[e_sorted]
    held = e_sorted < num_experts
    pos = torch.where(held, blk_start[e_sorted] * block_m + rank, maxb * block_m)  # slot maxb*block_m: dropped
    sorted_pairs = torch.full((maxb * block_m + 1,), P, dtype=torch.int32, device=dev)
    sorted_pairs[pos] = order.to(torch.int32)
    first = held & (rank % block_m == 0)
    bexp = torch.full((maxb + 1,), -1, dtype=torch.int32, device=dev)  # slot maxb swallows non-firsts
    bexp[torch.where(first, pos // block_m, maxb)] = torch.where(first, e_sorted, -1).to(torch.int32)
    return sorted_pairs[: maxb * block_m], bexp[:maxb]


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, force_torch: bool = False):
    """(sorted_pairs int32 [max_blocks*block_m], block_expert int32 [max_blocks]); see module doc."""
    P = topk_ids.numel()
    if force_torch or P > FAST_MAX_PAIRS or P == 0:
        return moe_align_torch(topk_ids, num_experts, block_m)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    maxb = max_blocks_for(P, num_experts, block_m)
    sorted_pairs = torch.empty(maxb * block_m, dtype=torch.int32, device=ids.device)
    bexp = torch.empty(maxb, dtype=torch.int32, device=ids.device)
    p_pad = max(16, triton.next_power_of_2(P))
    _moe_align_kernel[(1,)](ids, sorted_pairs, bexp, P, num_experts, maxb,
                            BLOCK_M=block_m, P_PAD=p_pad, FILL=1024, num_warps=4 if p_pad <= 1024 else 8)
    return sorted_pairs, bexp
