"""Triton kernels of `kernels.mla_attention`: position-aligned split-KV absorbed MLA over a paged cache.

Work unit: one query tile (the heads of ONE query token, BLOCK_M rows; with 64 heads a tile is one
token, more heads take several tiles) x one KV chunk. All heads share each latent row (MQA with a
576-wide key and a 512-wide value = the key's first 512 columns), so a KV tile is loaded once and
used by both MMAs: S = q_lat c_kv^T + q_pe k_pe^T, then O += P c_kv (FlashAttention-2 online softmax
in base 2, FlashMLA-style absorbed layout).

Keys by absolute position (DESIGN 3.2-3.5). A query at position p sees the keys at positions 0..p:
  - position k < L (the session's committed length) is logical cache row k;
  - position L + e (e = 0..depth) is the new row of the query's ancestor at depth e (itself at
    e = depth). Causal rows (new row j, p = L + j): row L + e, the identity. Tree rows: the e-th
    set bit of the row's ancestor bits (parents precede children, so ancestors in index order are
    in depth order), depth = popcount - 1. After acceptance the engine compacts the path rows to
    L + depth, so a node's keys are the keys of the AR step at its position, at the same positions.
Reduction order, a function of p alone (never of L, of the other rows, or of the batch): the K = p + 1
keys are cut into nc chunks of whole BLOCK_N-key tiles at absolute positions (`chunk_span`, the one
definition, also evaluated on the host), each reduced tile by tile in order; lanes past p load
nothing and add exact zeros. Two rules (constexpr RULE), both with at most NCH chunks, which bounds
the grid and the partials at long contexts:
  balanced (1, default): Tn = cdiv(K, BLOCK_N) tiles, nc = clamp(round(K / C_MIN), 1, NCH) (half up),
    chunk c = tiles [c*Tn // nc, (c+1)*Tn // nc): every chunk has floor(Tn / nc) or ceil(Tn / nc)
    tiles, the last one ceil, so no chunk is empty or short (with the default knobs >= 384 keys
    when nc > 1, <= 767 keys when nc = 1); the count is non-decreasing in K and, with the default
    knobs, never above legacy's, and from NCH * C_MIN keys on the longest chunk is legacy's.
  legacy (0): C = max(C_MIN, BLOCK_N * cdiv(cdiv(K, NCH), BLOCK_N)), nc = cdiv(K, C), chunk c =
    positions [c*C, min((c+1)*C, K)): with K just past a multiple of C the last chunk holds a few
    keys (a whole CTA and a partial for them).
Every tile goes through the same `_attend` code with a runtime mask, whichever loop feeds it, so a
tree node at depth d, the AR step at L + d and a causal prefill row at L + d give the same bits.
nc == 1: the kernel writes the output; else partials per chunk, (m, l) in fp32 and the unnormalized O in fp32 or
(the launcher's `partials="out"`) in the output's dtype (16-bit: columns in fragment order, `_fragment_col`), folded
in fp32 by `_mla_combine_kernel` in chunk order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _query_row(pid_t, HT, cu_ptr, pre_ptr, bits_ptr, stride_bits, S, S_PAD: tl.constexpr,
               TREE: tl.constexpr, NB: tl.constexpr):
    """Query tile id -> (token t, head block, session s, committed L, position p, ancestor bits [NB])."""
    t = pid_t // HT
    hb = pid_t % HT
    offs = tl.arange(0, S_PAD)
    hi = tl.load(cu_ptr + offs + 1, mask=offs < S, other=2147483647)
    s = tl.sum((hi <= t).to(tl.int32), 0)  # sessions that end at or before token t
    L = tl.load(pre_ptr + s)
    if TREE:
        k = tl.arange(0, NB)
        w = tl.load(bits_ptr + t.to(tl.int64) * stride_bits + k // 64)  # [NB] int64, word of bit k
        bit = ((w >> (k % 64).to(tl.int64)) & 1).to(tl.int32)
        p = L + tl.sum(bit, 0) - 1  # depth = number of ancestors (itself included) - 1
    else:
        bit = tl.zeros([NB], tl.int32)
        p = L + t - tl.load(cu_ptr + s)  # causal: new row j sits at position L + j
    return t, hb, s, L, p, bit


@triton.jit
def chunk_span(K, c, RULE: tl.constexpr, BLOCK_N: tl.constexpr, NCH: tl.constexpr, C_MIN: tl.constexpr):
    """A row of K keys (positions 0..K-1) -> (nc, start, end): its number of chunks and the positions
    [start, end) of chunk c < nc (module docstring). Only integer operators and builtin min/max on
    non-negative scalars, so `chunk_span.fn` evaluates the same rule on host ints."""
    if RULE == 0:  # legacy
        C = max(C_MIN, ((K + NCH - 1) // NCH + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
        nc = (K + C - 1) // C
        start = c * C
        end = min(start + C, K)
    else:  # balanced
        tiles = (K + BLOCK_N - 1) // BLOCK_N
        nc = max(1, min(NCH, (K + C_MIN // 2) // C_MIN))
        start = c * tiles // nc * BLOCK_N
        end = min((c + 1) * tiles // nc * BLOCK_N, K)
    return nc, start, end


@triton.jit
def _attend(q, qpe, m, l, o, kv_ptr, bt_row_ptr, stride_kv, idx, valid, qk_scale,
            DL: tl.constexpr, DR: tl.constexpr, BDL: tl.constexpr, BDR: tl.constexpr,
            PAGE: tl.constexpr, MASK_LOADS: tl.constexpr, PREC: tl.constexpr):
    """One KV tile (logical rows idx [BLOCK_N], seen where valid) folded into the running (m, l, o).

    MASK_LOADS only guards the loads (False where every lane is known valid); the arithmetic is the
    same code either way, so a tile's result depends only on its keys and its mask."""
    dl = tl.arange(0, BDL)
    dr = tl.arange(0, BDR)
    if MASK_LOADS:
        page = tl.load(bt_row_ptr + idx // PAGE, mask=valid, other=0)
    else:
        page = tl.load(bt_row_ptr + idx // PAGE)
    row = kv_ptr + (page.to(tl.int64) * PAGE + idx % PAGE)[:, None] * stride_kv  # physical pool rows
    if MASK_LOADS:
        ckv = tl.load(row + dl[None, :], mask=valid[:, None] & (dl < DL)[None, :], other=0.0)
        kpe = tl.load(row + DL + dr[None, :], mask=valid[:, None] & (dr < DR)[None, :], other=0.0)
    else:
        ckv = tl.load(row + dl[None, :], mask=(dl < DL)[None, :], other=0.0)
        kpe = tl.load(row + DL + dr[None, :], mask=(dr < DR)[None, :], other=0.0)
    sc = tl.dot(q, tl.trans(ckv), input_precision=PREC)  # [BLOCK_M, BLOCK_N] fp32
    sc = tl.dot(qpe, tl.trans(kpe), sc, input_precision=PREC)
    sc = tl.where(valid[None, :], sc * qk_scale, float("-inf"))  # log2 domain; past p: -inf
    m_new = tl.maximum(m, tl.max(sc, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.exp2(sc - m_use[:, None])
    alpha = tl.exp2(m - m_use)
    l = tl.fma(l, alpha, tl.sum(p, 1))
    o = o * alpha[:, None]
    o = tl.dot(p.to(ckv.dtype), ckv, o, input_precision=PREC)
    return m_new, l, o


@triton.jit
def _fragment_col(c):
    """Where column c of a 16-bit partial O is stored: within each 16-column group, c = 16 g + 8 jb + 2 q + e (a
    wgmma accumulator gives the thread of lane q % 4 the pairs at 2 q and 8 + 2 q) goes to 16 g + 4 q + 2 jb + e, so
    a thread's four values are 8 contiguous bytes (`_mla_gluon._store_partial`). Every kernel stores 16-bit
    partials this way; the combine folds them in that order (contiguous loads) and puts its result back in column
    order in registers. fp32 partials keep the plain order."""
    return c // 16 * 16 + (c // 2 % 4) * 4 + (c // 8 % 2) * 2 + c % 2


@triton.jit
def _chunk_partial(q, qpe, kv_ptr, bt_row, stride_kv, start, end, L, bit, rank, qk_scale,
                   DL: tl.constexpr, DR: tl.constexpr, BDL: tl.constexpr, BDR: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TREE: tl.constexpr, NB: tl.constexpr,
                   PREC: tl.constexpr):
    """(m, l, O) of the query tile over the keys at positions [start, end), from a fresh state."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    o = tl.zeros([BLOCK_M, BDL], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    if TREE:
        ident = tl.minimum(end, L)  # positions < L are committed rows; later ones go through the bits
    else:
        ident = end  # causal: every position is its own logical row
    a_end = start + tl.maximum(ident - start, 0) // BLOCK_N * BLOCK_N
    for k0 in range(start, a_end, BLOCK_N):  # hot loop: whole tiles of logical row = position
        idx = k0 + cols
        m, l, o = _attend(q, qpe, m, l, o, kv_ptr, bt_row, stride_kv, idx, idx < end, qk_scale,
                          DL, DR, BDL, BDR, PAGE, False, PREC)
    for k0 in range(a_end, end, BLOCK_N):  # the rest: ragged end, tiles reaching into the tree part
        pos = k0 + cols
        idx = pos
        if TREE:
            e = pos - L  # depth of the ancestor at this position (< 0: committed row)
            hit = (bit[None, :] != 0) & (rank[None, :] == e[:, None])  # [BLOCK_N, NB]
            anc = tl.sum(tl.where(hit, tl.arange(0, NB)[None, :], 0), 1)  # new-row index of that ancestor
            idx = tl.where(e >= 0, L + anc, pos)
        m, l, o = _attend(q, qpe, m, l, o, kv_ptr, bt_row, stride_kv, idx, pos < end, qk_scale,
                          DL, DR, BDL, BDR, PAGE, True, PREC)
    return m, l, o


@triton.jit
def _fold(m, l, o, mc, lc, oc):
    """One chunk's partial (mc, lc, oc: fp32, oc as it was read back) folded into the running (m, l, o): the
    arithmetic of `_mla_combine_kernel`'s loop, in one place for it and the fold kernels."""
    m_new = tl.maximum(m, mc)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m - m_use)
    b = tl.exp2(mc - m_use)
    return m_new, tl.fma(l, a, lc * b), tl.fma(o, a[:, None], oc * b[:, None])


@triton.jit
def _mla_fwd_kernel(
    q_ptr, qpe_ptr,  # [T, H, DL], [T, H, DR]
    kv_ptr,  # [num_slots, DL + DR] paged pool of one layer
    bt_ptr,  # [S, max_pages] int32 block table
    cu_ptr, pre_ptr,  # [S+1] int32 query offsets, [S] int32 committed lengths
    bits_ptr,  # [T, NB / 64] int64 ancestor bits (unused when not TREE)
    out_ptr,  # out: [T, H, DL]
    po_ptr,  # out: partial O [tiles * GC, BLOCK_M, BDL], fp32 or the output's dtype (FOLD: only its dtype is used)
    pml_ptr,  # out: partial (m, l) fp32 [tiles * GC, 2, BLOCK_M]
    nc_ptr,  # out: [tiles] int32 chunks of each query tile (read by the combine kernel)
    S, H, HT, GC, qk_scale,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_kv, stride_bt, stride_bits, stride_ot, stride_oh,
    DL: tl.constexpr, DR: tl.constexpr, BDL: tl.constexpr, BDR: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NCH: tl.constexpr, C_MIN: tl.constexpr, RULE: tl.constexpr,
    S_PAD: tl.constexpr, TREE: tl.constexpr, NB: tl.constexpr, PREC: tl.constexpr, FOLD: tl.constexpr,
):
    pid_t = tl.program_id(0)  # query tile = (token, head block)
    pid_c = tl.program_id(1)  # chunk (FOLD: 0, the program takes every chunk of its tile)
    t, hb, s, L, p, bit = _query_row(pid_t, HT, cu_ptr, pre_ptr, bits_ptr, stride_bits, S, S_PAD, TREE, NB)
    nc, start, end = chunk_span(p + 1, pid_c, RULE, BLOCK_N, NCH, C_MIN)  # this chunk's positions: [start, end)
    if pid_c == 0:
        tl.store(nc_ptr + pid_t, nc)
    if pid_c >= nc:
        return
    h = hb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = h < H
    t = t.to(tl.int64)
    dl = tl.arange(0, BDL)
    dr = tl.arange(0, BDR)
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + dl[None, :],
                mask=row_ok[:, None] & (dl < DL)[None, :], other=0.0)
    qpe = tl.load(qpe_ptr + t * stride_pt + h[:, None] * stride_ph + dr[None, :],
                  mask=row_ok[:, None] & (dr < DR)[None, :], other=0.0)
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt
    rank = tl.cumsum(bit, 0) - 1  # [NB] depth of each ancestor (valid where bit is set; TREE only)
    m, l, o = _chunk_partial(q, qpe, kv_ptr, bt_row, stride_kv, start, end, L, bit, rank, qk_scale, DL, DR, BDL,
                             BDR, PAGE, BLOCK_M, BLOCK_N, TREE, NB, PREC)
    if FOLD and nc > 1:  # the tile's chunks in order, each folded as the combine kernel would fold its partial
        m, l, o = _fold(tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
                        tl.zeros([BLOCK_M, BDL], tl.float32), m, l, o.to(po_ptr.dtype.element_ty).to(tl.float32))
        for c in range(1, nc):
            _, start, end = chunk_span(p + 1, c, RULE, BLOCK_N, NCH, C_MIN)
            mc, lc, oc = _chunk_partial(q, qpe, kv_ptr, bt_row, stride_kv, start, end, L, bit, rank, qk_scale, DL,
                                        DR, BDL, BDR, PAGE, BLOCK_M, BLOCK_N, TREE, NB, PREC)
            m, l, o = _fold(m, l, o, mc, lc, oc.to(po_ptr.dtype.element_ty).to(tl.float32))
    if nc == 1 or FOLD:
        out = o / tl.where(l == 0.0, 1.0, l)[:, None]  # l == 0 only for a row that sees nothing
        tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + dl[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dl < DL)[None, :])
    else:
        part = (pid_t * GC + pid_c).to(tl.int64)
        rm = tl.arange(0, BLOCK_M)
        col = _fragment_col(dl) if po_ptr.dtype.element_ty.primitive_bitwidth == 16 else dl
        tl.store(po_ptr + part * (BLOCK_M * BDL) + rm[:, None] * BDL + col[None, :], o.to(po_ptr.dtype.element_ty))
        tl.store(pml_ptr + part * (2 * BLOCK_M) + rm, m)
        tl.store(pml_ptr + part * (2 * BLOCK_M) + BLOCK_M + rm, l)


@triton.jit
def _mla_combine_kernel(
    po_ptr, pml_ptr, nc_ptr,  # partials and chunk counts from _mla_fwd_kernel
    out_ptr,  # out: [T, H, DL] (rows of single-chunk tiles were written by _mla_fwd_kernel)
    H, HT, GC, stride_ot, stride_oh,
    DL: tl.constexpr, BDL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, TRIGGER: tl.constexpr = False,
):
    if TRIGGER:  # `kernels.pdl`: a PDL launch after this one may start now (it waits for our end to read)
        tl.extra.cuda.gdc_launch_dependents()
    pid_t = tl.program_id(0)
    nc = tl.load(nc_ptr + pid_t)
    if nc == 1:
        return
    rm = tl.arange(0, BLOCK_M)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    o = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # 16-bit partials: columns in their stored (fragment) order
    for c in range(nc):  # chunk order: fixed
        part = (pid_t * GC + c).to(tl.int64)
        mc = tl.load(pml_ptr + part * (2 * BLOCK_M) + rm)
        lc = tl.load(pml_ptr + part * (2 * BLOCK_M) + BLOCK_M + rm)
        oc = tl.load(po_ptr + part * (BLOCK_M * BDL) + rm[:, None] * BDL + d[None, :]).to(tl.float32)
        m, l, o = _fold(m, l, o, mc, lc, oc)
    t = (pid_t // HT).to(tl.int64)
    h = (pid_t % HT) * BLOCK_M + rm
    out = o / tl.where(l == 0.0, 1.0, l)[:, None]
    if po_ptr.dtype.element_ty.primitive_bitwidth == 16:  # back to column order (`_fragment_col`'s inverse)
        out = tl.reshape(tl.permute(tl.reshape(out, [BLOCK_M, BLOCK_D // 16, 4, 2, 2]), [0, 1, 3, 2, 4]),
                         [BLOCK_M, BLOCK_D])
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(h < H)[:, None] & (d < DL)[None, :])
