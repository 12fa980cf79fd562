"""The first k of a stable descending sort along the last dim (ties: lower index first): torch reference + Triton.

The tree build ranks each depth's vocabulary by (log q desc, token id asc) and keeps the first K (`build_tree`).
Both implementations turn every value into one unique int64 key, (order-preserving bits of the float) << 32 |
(n - 1 - index), so "the k largest keys" is exactly that ranking with no ties left.

`top_k_stable_ref` is one `torch.topk` over the keys (a radix select over 8-byte keys after four full passes that
build them): at K2.6 shapes (vocabulary 163840, 7 depths) and 32 requests it took ~1.7 ms of a 7 ms draft step on
an H200 (`bench/bench_draft_step.py --profile`). `_segment_topk_kernel` reads each row once: one program per
(row, segment of SEG values) builds the keys in registers and extracts its segment's k largest (k max-reductions),
`_merge_topk_kernel` extracts the row's k largest of those candidates and gathers the values. Same keys, same
result, bit for bit (CPU tests under TRITON_INTERPRET=1 against the reference, ties included).

`top_k_stable` is the launcher: the kernels on CUDA for float32 rows and k <= MAX_K, the reference elsewhere.
Inputs must hold no NaN (the tree build clamps its log-probs first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 64  # larger k: the reference (k max-reductions per segment would cost more than the radix select)
SEG = 2048  # values per first-stage program


def top_k_stable_ref(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [..., n] without NaN -> (values, int64 indices) [..., k] of the first k of a stable descending
    sort (ties: lower index first; -0.0 ranks equal to +0.0)."""
    n = x.shape[-1]
    b = (x + 0.0).view(torch.int32)  # + 0.0: -0.0 -> +0.0, equal under the sort
    ordered = torch.where(b >= 0, b, b ^ 0x7FFFFFFF).to(torch.int64)  # increasing with x
    key = (ordered << 32) | (n - 1 - torch.arange(n, device=x.device))
    idx = torch.topk(key, k, dim=-1, sorted=True).indices
    return x.gather(-1, idx), idx


@triton.jit
def _segment_topk_kernel(x_ptr, cand_ptr, n, stride_x, n_seg, K: tl.constexpr, SEG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    i = seg * SEG + tl.arange(0, SEG)
    ok = i < n
    x = tl.load(x_ptr + row * stride_x + i, mask=ok, other=0.0) + 0.0  # -0.0 -> +0.0
    b = x.to(tl.int32, bitcast=True)
    ordered = tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)
    key = (ordered << 32) | (n - 1 - i).to(tl.int64)
    low = tl.full([SEG], -9223372036854775807, tl.int64)  # below every real key
    key = tl.where(ok, key, low)
    out = cand_ptr + (row * n_seg + seg) * K
    for j in tl.static_range(K):
        m = tl.max(key, 0)
        tl.store(out + j, m)
        key = tl.where(key == m, low, key)  # keys are unique: this takes exactly the one extracted


@triton.jit
def _merge_topk_kernel(x_ptr, cand_ptr, val_ptr, idx_ptr, n, stride_x, n_cand, K: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    low = tl.full([BLOCK], -9223372036854775807, tl.int64)
    key = tl.load(cand_ptr + row * n_cand + c, mask=c < n_cand, other=-9223372036854775807)  # past the end: low
    for j in tl.static_range(K):
        m = tl.max(key, 0)
        idx = (n - 1) - (m & 0xFFFFFFFF)
        tl.store(idx_ptr + row * K + j, idx)
        tl.store(val_ptr + row * K + j, tl.load(x_ptr + row * stride_x + idx))
        key = tl.where(key == m, low, key)


def top_k_stable_triton(x: torch.Tensor, k: int, seg: int = SEG) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path on any device (tests run it on CPU under TRITON_INTERPRET=1); arguments as the reference.
    `seg` (a power of two) is a test knob: the result does not depend on it."""
    n = x.shape[-1]
    if x.dtype != torch.float32 or not 1 <= k <= min(n, MAX_K) or seg & (seg - 1):
        raise ValueError(f"top_k_stable: float32 rows and 1 <= k <= min(n, {MAX_K}), got {x.dtype}, k={k}, n={n}")
    if n >= 2**31:
        raise ValueError(f"top_k_stable: rows of {n} values do not fit the 32-bit index of the keys")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    vals = torch.empty(rows, k, dtype=x.dtype, device=x.device)
    idx = torch.empty(rows, k, dtype=torch.int64, device=x.device)
    if rows:
        n_seg = triton.cdiv(n, seg)
        cand = torch.empty(rows, n_seg * k, dtype=torch.int64, device=x.device)
        _segment_topk_kernel[(rows, n_seg)](x2, cand, n, x2.stride(0), n_seg, K=k, SEG=seg, num_warps=4)
        _merge_topk_kernel[(rows,)](x2, cand, vals, idx, n, x2.stride(0), n_seg * k, K=k,
                                    BLOCK=max(16, triton.next_power_of_2(n_seg * k)), num_warps=4)
    return vals.view(*lead, k), idx.view(*lead, k)


def top_k_stable(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the first k of a stable descending sort of x (module doc) along the last dim."""
    if x.is_cuda and x.dtype == torch.float32 and 1 <= k <= min(x.shape[-1], MAX_K) and x.shape[-1] < 2**31:
        return top_k_stable_triton(x, k)
    return top_k_stable_ref(x, k)
