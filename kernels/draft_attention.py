"""The DFlash drafter's block attention straight from its context ring cache: torch reference + Triton kernel.

Per request r and KV head j, the `groups` query heads that share KV head j are `groups * B` query rows (B: the
block) attending, unmasked and bidirectionally, to the request's valid context rows (ring slots 0 ..
ctx_len[r] - 1 of cache row rows[r]; ring order does not matter, rope is already applied) and to the block's own
B keys. Softmax scale 1 / sqrt(head_dim).

`draft_attention_ref` is what the drafter computed before this kernel and defines correctness: gather the
requests' whole windows out of the cache (`cache[rows]`), append the block, mask the rows past ctx_len, SDPA.
That costs two copies of every request's whole window per layer (the gather, the concatenation) and attention over
all of it whatever the context length: at K2.6 shapes (8 KV heads x 128, window 1024) and 32 sessions, 2.3 ms of a
9.3 ms draft step on an H200 (`bench/bench_draft_step.py --profile`). `_draft_attention_kernel` reads the cache
rows in place by the request's row index and stops at its context length: one program per (request, KV head),
key tiles of BLOCK_N with an online softmax in fp32, then the block's keys.

`draft_attention` is the launcher: the kernel on CUDA for 16-bit / fp32 inputs with a power-of-two head_dim, the
reference elsewhere (the CPU path; the tests run the kernel on CPU under TRITON_INTERPRET=1). Drafts need not be
batch invariant (the verifier decides what is accepted), and the kernel's bits differ from SDPA's; the in-process
and served drafters run the same path, so they agree with each other. With fp32 inputs on a GPU `tl.dot` runs in
TF32 (Triton's default; SDPA does not): good enough for drafts, and served drafters are bf16; an `input_precision`
of "ieee" for fp32 was written but never ran on a GPU, so it is not in.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _online_tile(q, k_ptrs, v_ptrs, ok, mx, l, acc, qk_scale):
    """One tile of keys (rows where `ok`) into the online softmax state (running max, sum, accumulator)."""
    k = tl.load(k_ptrs, mask=ok[:, None], other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    new = tl.maximum(mx, tl.max(s, 1))
    p = tl.math.exp2(s - new[:, None])
    alpha = tl.math.exp2(mx - new)
    v = tl.load(v_ptrs, mask=ok[:, None], other=0.0).to(q.dtype)
    return new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)


@triton.jit
def _draft_attention_kernel(
    q_ptr,  # [R, KV, M, hd]
    ck_ptr, cv_ptr,  # one layer's cache [S, W, KV, hd]
    rows_ptr, len_ptr,  # [R] int64: cache row, valid context rows
    kb_ptr, vb_ptr,  # [R, B, KV, hd] the block's keys and values
    o_ptr,  # out: [R, KV, M, hd]
    M, B, qk_scale,  # qk_scale: log2(e) / sqrt(hd)
    s_qr, s_qj, s_qm,
    s_cs, s_cw, s_cj,
    s_br, s_bb, s_bj,
    s_or, s_oj, s_om,
    HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + r * s_qr + j * s_qj + m[:, None] * s_qm + d[None, :], mask=m[:, None] < M, other=0.0)
    row = tl.load(rows_ptr + r)
    n_ctx = tl.load(len_ptr + r)
    mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    ck = ck_ptr + row * s_cs + j * s_cj + d[None, :]
    cv = cv_ptr + row * s_cs + j * s_cj + d[None, :]
    for start in range(0, n_ctx, BLOCK_N):  # the context rows, up to the request's length
        w = (start + n)[:, None] * s_cw
        mx, l, acc = _online_tile(q, ck + w, cv + w, start + n < n_ctx, mx, l, acc, qk_scale)
    b = tl.arange(0, BLOCK_B)  # the block's own keys: always visible
    blk = r * s_br + j * s_bj + b[:, None] * s_bb + d[None, :]
    mx, l, acc = _online_tile(q, kb_ptr + blk, vb_ptr + blk, b < B, mx, l, acc, qk_scale)
    out = (acc / l[:, None]).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + r * s_or + j * s_oj + m[:, None] * s_om + d[None, :], out, mask=m[:, None] < M)


def _check(q, cache_k, cache_v, rows, ctx_len, k_blk, v_blk) -> None:
    R, KV, _, hd = q.shape
    if cache_k.dim() != 4 or cache_k.shape != cache_v.shape or cache_k.shape[2:] != (KV, hd):
        raise ValueError(f"draft_attention: cache {tuple(cache_k.shape)} / {tuple(cache_v.shape)} is not "
                         f"[sessions, window, {KV}, {hd}]")
    if k_blk.shape != v_blk.shape or k_blk.dim() != 4 or k_blk.shape[0] != R or k_blk.shape[2:] != (KV, hd):
        raise ValueError(f"draft_attention: block keys {tuple(k_blk.shape)} / values {tuple(v_blk.shape)} are not "
                         f"[{R}, B, {KV}, {hd}]")
    if rows.shape != (R,) or ctx_len.shape != (R,):
        raise ValueError(f"draft_attention: rows {tuple(rows.shape)} and ctx_len {tuple(ctx_len.shape)} must be [{R}]")


def draft_attention_ref(q, cache_k, cache_v, rows, ctx_len, k_blk, v_blk) -> torch.Tensor:
    """q [R, KV, M, hd] (M = groups * B query rows per KV head); cache_k / cache_v [S, W, KV, hd] (one layer);
    rows, ctx_len [R] int64; k_blk / v_blk [R, B, KV, hd] -> [R, KV, M, hd] in q's dtype."""
    _check(q, cache_k, cache_v, rows, ctx_len, k_blk, v_blk)
    W, B = cache_k.shape[1], k_blk.shape[1]
    k = torch.cat((cache_k[rows], k_blk), dim=1)  # [R, W + B, KV, hd]
    v = torch.cat((cache_v[rows], v_blk), dim=1)
    valid = torch.arange(W + B, device=q.device)[None, :] < ctx_len[:, None]
    valid[:, W:] = True  # block rows always visible (bidirectional)
    return F.scaled_dot_product_attention(q, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
                                          attn_mask=valid[:, None, None, :])


def draft_attention_triton(q, cache_k, cache_v, rows, ctx_len, k_blk, v_blk, block_n: int = 64) -> torch.Tensor:
    """The Triton path on any device (tests call it on CPU under TRITON_INTERPRET=1); arguments as the reference.
    ctx_len must not exceed the window (the cache's valid rows)."""
    _check(q, cache_k, cache_v, rows, ctx_len, k_blk, v_blk)
    R, KV, M, hd = q.shape
    B = k_blk.shape[1]
    if hd & (hd - 1) or hd < 16:
        raise ValueError(f"draft_attention: head_dim {hd} must be a power of two >= 16")
    if any(t.stride(-1) != 1 for t in (q, cache_k, cache_v, k_blk, v_blk)):
        raise ValueError("draft_attention: head_dim must be the contiguous dimension")
    out = torch.empty(R, KV, M, hd, dtype=q.dtype, device=q.device)
    if R == 0 or M == 0:
        return out
    rows, ctx_len = rows.to(torch.int64).contiguous(), ctx_len.to(torch.int64).contiguous()
    _draft_attention_kernel[(R, KV)](
        q, cache_k, cache_v, rows, ctx_len, k_blk, v_blk, out, M, B, math.log2(math.e) / math.sqrt(hd),
        q.stride(0), q.stride(1), q.stride(2), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        k_blk.stride(0), k_blk.stride(1), k_blk.stride(2), out.stride(0), out.stride(1), out.stride(2),
        HD=hd, BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_B=max(16, triton.next_power_of_2(B)),
        num_warps=4, num_stages=2)
    return out


def draft_attention(q, cache_k, cache_v, rows, ctx_len, k_blk, v_blk) -> torch.Tensor:
    """The drafter's block attention (module doc): the Triton kernel on CUDA where it applies, else the reference."""
    hd = q.shape[-1]
    if (q.is_cuda and q.dtype in _DTYPES and cache_k.dtype == q.dtype and not torch.is_grad_enabled()
            and hd >= 16 and not hd & (hd - 1) and q.stride(-1) == 1 and cache_k.stride(-1) == 1
            and cache_v.stride(-1) == 1 and k_blk.stride(-1) == 1 and v_blk.stride(-1) == 1):
        return draft_attention_triton(q, cache_k, cache_v, rows, ctx_len, k_blk, v_blk)
    return draft_attention_ref(q, cache_k, cache_v, rows, ctx_len, k_blk, v_blk)
