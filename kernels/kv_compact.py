"""KV-cache compaction after acceptance (DESIGN 3.3), on the device.

Owns `path_moves` (which logical cache rows the accepted path moves where), `block_slots` (logical rows ->
physical slots through a block table), `commit_moves` (both, for a verify step: the physical moves, in one Triton
launch on CUDA or ~25 torch launches) and `compact_kv` (the in-place row move itself). Tree node k of session r was
written at logical index L_r + k (L_r = committed length); after acceptance, path entry j must live at L_r + j so the
committed prefix is contiguous. No host sync, CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.step_impl import use_kernel


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


def block_slots(block_table: Tensor, page_size: int, rows: Tensor, logical: Tensor) -> Tensor:
    """rows [R] (block-table rows), logical [R, X] int -> physical slots [R, X] int64 (a page index past the table's
    width is clamped to its last column: such rows are never read)."""
    page_idx = (logical // page_size).long().clamp(max=block_table.shape[1] - 1)
    pages = block_table[rows[:, None].long(), page_idx]
    return pages.long() * page_size + logical.long() % page_size


def commit_moves_reference(path: Tensor, accept_len: Tensor, rows: Tensor, committed: Tensor, block_table: Tensor,
                           page_size: int, scratch: int) -> tuple[Tensor, Tensor]:
    """A verify step's KV moves as physical slots: path [S, D+1], accept_len [S] (`kernels.tree_accept`), rows [S]
    (block-table rows), committed [S] -> (src, dst) [S, D+1] int64: entry j moves the accepted node path[s, j] (at
    committed + path[s, j]) to committed + j for j <= accept_len; the other entries move `scratch` onto itself
    (padding moves must not alias rows outside the session's pages)."""
    src_rel, dst_rel = path_moves(path, accept_len)
    live = torch.arange(path.shape[1], device=path.device)[None, :] <= accept_len.long()[:, None]
    base = committed.long()[:, None]
    src = torch.where(live, block_slots(block_table, page_size, rows, base + src_rel), scratch)
    dst = torch.where(live, block_slots(block_table, page_size, rows, base + dst_rel), scratch)
    return src, dst


@triton.jit
def _slot(bt_ptr, row, logical, page_size, width):
    page = tl.load(bt_ptr + row * width + tl.minimum(logical // page_size, width - 1))
    return page.to(tl.int64) * page_size + logical % page_size


@triton.jit(do_not_specialize=["D1", "page_size", "width", "scratch"])
def _commit_moves_kernel(path_ptr, len_ptr, rows_ptr, committed_ptr, bt_ptr, src_ptr, dst_ptr, D1, page_size, width,
                         scratch, DB: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, DB).to(tl.int64)
    inb = j < D1
    live = j <= tl.load(len_ptr + s).to(tl.int64)
    p = tl.load(path_ptr + s * D1 + j, mask=inb, other=-1).to(tl.int64)
    row = tl.load(rows_ptr + s).to(tl.int64)
    base = tl.load(committed_ptr + s).to(tl.int64)
    src = _slot(bt_ptr, row, base + tl.where(live & (p >= 0), p, j), page_size, width)
    dst = _slot(bt_ptr, row, base + j, page_size, width)
    tl.store(src_ptr + s * D1 + j, tl.where(live, src, scratch), mask=inb)
    tl.store(dst_ptr + s * D1 + j, tl.where(live, dst, scratch), mask=inb)


def commit_moves(path: Tensor, accept_len: Tensor, rows: Tensor, committed: Tensor, block_table: Tensor,
                 page_size: int, scratch: int, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """`commit_moves_reference`'s contract. impl: auto (one Triton launch on CUDA, the reference elsewhere), triton
    (on CPU needs TRITON_INTERPRET=1) or torch. No host reads."""
    if not use_kernel(impl, path.is_cuda):
        return commit_moves_reference(path, accept_len, rows, committed, block_table, page_size, scratch)
    S, D1 = path.shape
    if accept_len.shape != (S,) or rows.shape != (S,) or committed.shape != (S,) or block_table.dim() != 2:
        raise ValueError(f"commit_moves: shapes path {tuple(path.shape)}, accept_len {tuple(accept_len.shape)}, "
                         f"rows {tuple(rows.shape)}, committed {tuple(committed.shape)}, "
                         f"block_table {tuple(block_table.shape)}")
    src = torch.empty(S, D1, dtype=torch.int64, device=path.device)
    dst = torch.empty_like(src)
    if S and D1:
        _commit_moves_kernel[(S,)](path.contiguous(), accept_len.contiguous(), rows.contiguous(),
                                   committed.contiguous(), block_table.contiguous(), src, dst, D1, page_size,
                                   block_table.shape[1], scratch, DB=triton.next_power_of_2(D1))
    return src, dst
