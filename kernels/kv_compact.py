"""KV-cache compaction after acceptance (DESIGN 3.3), on the device.

Owns `path_moves` (which logical cache rows the accepted path moves where) and `compact_kv`
(the in-place row move itself). Tree node k of session r was written at logical index
L_r + k (L_r = committed length); after acceptance, path entry j must live at L_r + j so the
committed prefix is contiguous. The caller maps logical indices to physical slots through its
block table. Fixed-shape torch ops only: no host sync, CUDA-graph capturable.
"""

from __future__ import annotations

import torch
from torch import Tensor


def path_moves(path: Tensor, accept_len: Tensor, base_index: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Row moves that make the accepted path contiguous.

    path: [R, D+1] int (node indices by depth, node 0 first, -1 = padding); accept_len: [R] int;
    base_index: optional [R] int, the committed length L_r of each session (0 if None).
    Returns (src, dst), both [R, D+1] int64 logical indices: entry j moves L_r + path[r, j] to
    L_r + j for j <= accept_len[r]; the rest are no-ops (src == dst). dst is never repeated
    within a row, so the moves are a valid input to `compact_kv`.
    """
    R, D1 = path.shape
    j = torch.arange(D1, device=path.device, dtype=torch.int64)[None, :].expand(R, D1)  # [R, D+1]
    live = (j <= accept_len.to(torch.int64)[:, None]) & (path >= 0)
    src = torch.where(live, path.long(), j)
    dst = j
    if base_index is not None:
        base = base_index.to(torch.int64)[:, None]
        src, dst = src + base, dst + base
    return src, dst.clone()


def compact_kv(cache: Tensor, src: Tensor, dst: Tensor) -> None:
    """In place: cache[..., dst[p], :] = old cache[..., src[p], :] for every move p.

    cache: [..., S, C] (slot dim = -2; leading dims, e.g. layers, move together).
    src, dst: int64 slot indices of any (equal) shape; dst must hold no duplicates. All sources
    are gathered before any write, so overlapping moves (a slot that is both a source and a
    destination) are correct; src == dst entries are no-ops.
    """
    if src.shape != dst.shape:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} differ")
    s, d = src.reshape(-1).long(), dst.reshape(-1).long()
    rows = cache.index_select(-2, s)  # [..., P, C] gather: a copy, read before any write
    cache.index_copy_(cache.dim() - 2, d, rows)
