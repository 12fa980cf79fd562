"""Tree attention masks on the device (DESIGN 3.1): ancestor masks and their bit packing.

Owns `ancestor_mask` (row i sees exactly node i and its ancestors; derived on the verifier from
`parent`, never trusted from the wire) and `pack_mask_bits` / `unpack_mask_bits` (64 columns per
int64 word, the layout attention kernels read). Fixed-shape torch ops only: no host sync, no
data-dependent loops, so all of it can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def ancestor_mask(parent: Tensor) -> Tensor:
    """[R, M] int parent (-1 = none) -> [R, M, M] bool, row i True at i and its ancestors.

    A node whose parent is -1 (the root, or padding) is a root of its own and sees only itself;
    parent values outside [0, M) are treated as -1. Pointer jumping: after k rounds row i holds
    the ancestors at distance < 2**k, so ceil(log2(M)) + 1 fixed rounds cover any depth < M.
    """
    R, M = parent.shape
    dev = parent.device
    p = parent.long()
    # Row/pointer M is a sentinel: an empty row that points at itself.
    ptr = torch.where((p >= 0) & (p < M), p, M)  # [R, M] int64
    ptr = torch.cat([ptr, torch.full((R, 1), M, dtype=torch.int64, device=dev)], dim=1)  # [R, M+1]
    mask = torch.zeros(R, M + 1, M, dtype=torch.bool, device=dev)  # [R, M+1, M]
    mask[:, :M] = torch.eye(M, dtype=torch.bool, device=dev)
    rounds = math.ceil(math.log2(M)) + 1 if M > 1 else 0
    for _ in range(rounds):
        # mask[i] |= mask[ptr[i]]; ptr[i] = ptr[ptr[i]] (the ancestor twice as far up)
        mask = mask | mask.gather(1, ptr[:, :, None].expand(R, M + 1, M))
        ptr = ptr.gather(1, ptr)
    return mask[:, :M]


def _bit_weights(device: torch.device) -> Tensor:
    """[64] int64, weight k = 1 << k (k = 63 is INT64_MIN: the sign bit)."""
    return torch.bitwise_left_shift(
        torch.ones(64, dtype=torch.int64, device=device), torch.arange(64, dtype=torch.int64, device=device)
    )


def pack_mask_bits(mask: Tensor) -> Tensor:
    """[..., M, N] bool -> [..., M, ceil(N/64)] int64; bit k of word w = column 64*w + k."""
    *lead, M, N = mask.shape
    nw = max(1, math.ceil(N / 64))
    padded = torch.nn.functional.pad(mask.to(torch.int64), (0, nw * 64 - N))  # [..., M, nw*64]
    bits = padded.reshape(*lead, M, nw, 64)
    # Bits are disjoint, so the sum is their OR; with bit 63 set it wraps to a negative word.
    return (bits * _bit_weights(mask.device)).sum(-1)


def unpack_mask_bits(words: Tensor, n_cols: int | None = None) -> Tensor:
    """Inverse of pack_mask_bits: [..., M, W] int64 -> [..., M, n_cols] bool (default n_cols = M)."""
    *lead, M, nw = words.shape
    n = M if n_cols is None else n_cols
    if n > nw * 64:
        raise ValueError(f"{nw} words hold at most {nw * 64} columns, asked for {n}")
    shifts = torch.arange(64, dtype=torch.int64, device=words.device)
    bits = torch.bitwise_right_shift(words[..., None], shifts).bitwise_and(1)  # [..., M, nw, 64]
    return bits.reshape(*lead, M, nw * 64)[..., :n].bool()
