"""Triton kernels of `kernels.mla_attention`: split-KV absorbed MLA over a paged latent cache.

Work unit: one query tile (BLOCK_M rows of flattened (token, head) pairs of ONE session; with 64
heads a tile is one token) x one KV chunk. All heads share each latent row (MQA with a 576-wide
key and a 512-wide value = the key's first 512 columns), so a KV tile is loaded once and used by
both MMAs: S = q_lat c_kv^T + q_pe k_pe^T, then O += P c_kv (FlashAttention-2 online softmax in
base 2, FlashMLA-style absorbed layout).

KV chunks: the committed prefix [0, L) of a session is cut at multiples of
    C(L) = max(C_MIN, BLOCK_N * cdiv(cdiv(L, NCH), BLOCK_N))          (<= NCH chunks)
and the session's new rows (tree nodes under the ancestor bitmask, or causal) are processed, masked,
at the end of the last chunk. C depends on the session's own committed length only, never on
the other sessions or on how many new rows the session has, so a row's reduction order is fixed
(batch invariance, DESIGN 3.5). Sessions with one chunk write the output directly; others write
fp32 partials (m, l, O) that `_mla_combine_kernel` folds in chunk order by log-sum-exp.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_session(pid_t, cu_ptr, pre_ptr, S, H, BLOCK_M: tl.constexpr, NCH: tl.constexpr,
                  C_MIN: tl.constexpr, BLOCK_N: tl.constexpr, S_PAD: tl.constexpr):
    """Global query-tile id -> (session, tile in session, first token, n new, L, chunk size, chunks,
    first partial slot). Tiles are numbered session by session; ids past the last are s == S."""
    offs = tl.arange(0, S_PAD)
    lo = tl.load(cu_ptr + offs, mask=offs < S, other=0)
    hi = tl.load(cu_ptr + offs + 1, mask=offs < S, other=0)
    pre = tl.load(pre_ptr + offs, mask=offs < S, other=0)
    tiles = (hi - lo) * H
    tiles = (tiles + BLOCK_M - 1) // BLOCK_M
    csz = tl.maximum(C_MIN, (((pre + NCH - 1) // NCH + BLOCK_N - 1) // BLOCK_N) * BLOCK_N)
    nch = tl.maximum(1, (pre + csz - 1) // csz)
    cum = tl.cumsum(tiles, 0)
    parts = tl.cumsum(tiles * nch, 0)
    s = tl.sum((cum <= pid_t).to(tl.int32), 0)
    sel = offs == s
    tile = pid_t - tl.sum(tl.where(sel, cum - tiles, 0), 0)
    t0 = tl.sum(tl.where(sel, lo, 0), 0)
    n = tl.sum(tl.where(sel, hi - lo, 0), 0)
    L = tl.sum(tl.where(sel, pre, 0), 0)
    C = tl.sum(tl.where(sel, csz, 0), 0)
    nc = tl.sum(tl.where(sel, nch, 0), 0)
    part0 = tl.sum(tl.where(sel, parts - tiles * nch, 0), 0) + tile * nc
    return s, tile, t0, n, L, C, nc, part0


@triton.jit
def _attend(q, qpe, m, l, o, kv_ptr, bt_row_ptr, stride_kv, idx, valid, vis, qk_scale,
            DL: tl.constexpr, DR: tl.constexpr, BDL: tl.constexpr, BDR: tl.constexpr,
            PAGE: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr):
    """One KV tile (logical rows idx [BLOCK_N], loaded where valid, seen where vis [BLOCK_M, BLOCK_N])
    folded into the running (m, l, o) of the tile's query rows."""
    dl = tl.arange(0, BDL)
    dr = tl.arange(0, BDR)
    if MASKED:
        page = tl.load(bt_row_ptr + idx // PAGE, mask=valid, other=0)
    else:
        page = tl.load(bt_row_ptr + idx // PAGE)
    row = kv_ptr + (page.to(tl.int64) * PAGE + idx % PAGE)[:, None] * stride_kv  # physical pool rows
    if MASKED:
        ckv = tl.load(row + dl[None, :], mask=valid[:, None] & (dl < DL)[None, :], other=0.0)
        kpe = tl.load(row + DL + dr[None, :], mask=valid[:, None] & (dr < DR)[None, :], other=0.0)
    else:
        ckv = tl.load(row + dl[None, :], mask=(dl < DL)[None, :], other=0.0)
        kpe = tl.load(row + DL + dr[None, :], mask=(dr < DR)[None, :], other=0.0)
    sc = tl.dot(q, tl.trans(ckv), input_precision=PREC)  # [BLOCK_M, BLOCK_N] fp32
    sc = tl.dot(qpe, tl.trans(kpe), sc, input_precision=PREC)
    sc = sc * qk_scale  # log2 domain
    if MASKED:
        sc = tl.where(vis, sc, float("-inf"))
    m_new = tl.maximum(m, tl.max(sc, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.exp2(sc - m_use[:, None])
    alpha = tl.exp2(m - m_use)
    l = tl.fma(l, alpha, tl.sum(p, 1))
    o = o * alpha[:, None]
    o = tl.dot(p.to(ckv.dtype), ckv, o, input_precision=PREC)
    return m_new, l, o


@triton.jit
def _mla_fwd_kernel(
    q_ptr, qpe_ptr,  # [T, H, DL], [T, H, DR]
    kv_ptr,  # [num_slots, DL + DR] paged pool of one layer
    bt_ptr,  # [S, max_pages] int32 block table
    cu_ptr, pre_ptr,  # [S+1] int32 query offsets, [S] int32 committed lengths
    bits_ptr,  # [T, W] int64 ancestor bits, W <= 2 (unused when not TREE)
    out_ptr,  # out: [T, H, DL]
    po_ptr, pml_ptr,  # out: partials fp32 [parts, BLOCK_M, BDL], [parts, 2, BLOCK_M]
    S, H, qk_scale,
    stride_qt, stride_qh, stride_pt, stride_ph, stride_kv, stride_bt, stride_bits, stride_ot, stride_oh,
    DL: tl.constexpr, DR: tl.constexpr, BDL: tl.constexpr, BDR: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NCH: tl.constexpr, C_MIN: tl.constexpr,
    S_PAD: tl.constexpr, TREE: tl.constexpr, TWO_WORDS: tl.constexpr, PREC: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    s, tile, t0, n, L, C, nc, part0 = _tile_session(pid_t, cu_ptr, pre_ptr, S, H, BLOCK_M, NCH, C_MIN,
                                                    BLOCK_N, S_PAD)
    if (s >= S) | (pid_c >= nc):
        return
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # row = j * H + h inside the session
    row_ok = r < n * H
    j = r // H
    h = r % H
    t = (t0 + j).to(tl.int64)
    dl = tl.arange(0, BDL)
    dr = tl.arange(0, BDR)
    q = tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + dl[None, :],
                mask=row_ok[:, None] & (dl < DL)[None, :], other=0.0)
    qpe = tl.load(qpe_ptr + t[:, None] * stride_pt + h[:, None] * stride_ph + dr[None, :],
                  mask=row_ok[:, None] & (dr < DR)[None, :], other=0.0)
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    o = tl.zeros([BLOCK_M, BDL], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    start = pid_c * C
    end = tl.minimum(start + C, L)  # committed rows of this chunk: [start, end), no mask
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    for k0 in range(start, full_end, BLOCK_N):  # hot loop: whole committed tiles
        idx = k0 + cols
        m, l, o = _attend(q, qpe, m, l, o, kv_ptr, bt_row, stride_kv, idx, idx >= 0, None, qk_scale,
                          DL, DR, BDL, BDR, PAGE, False, PREC)
    if full_end < end:  # ragged end of the chunk
        idx = full_end + cols
        m, l, o = _attend(q, qpe, m, l, o, kv_ptr, bt_row, stride_kv, idx, idx < end, (idx < end)[None, :],
                          qk_scale, DL, DR, BDL, BDR, PAGE, True, PREC)
    if pid_c == nc - 1:  # the last chunk goes on over the session's new rows, masked
        if TREE:
            k_end = n
            # ancestor bits of each query row as four 32-bit halves (nodes 0-31, 32-63, 64-95, 96-127);
            # a tile of BLOCK_N (divides 32) new rows reads one half
            w0 = tl.load(bits_ptr + t * stride_bits, mask=row_ok, other=0)
            b0 = (w0 & 0xFFFFFFFF).to(tl.int32)
            b1 = (w0 >> 32).to(tl.int32)
            if TWO_WORDS:
                w1 = tl.load(bits_ptr + t * stride_bits + 1, mask=row_ok, other=0)
                b2 = (w1 & 0xFFFFFFFF).to(tl.int32)
                b3 = (w1 >> 32).to(tl.int32)
        else:
            k_end = tl.minimum(n, (tile * BLOCK_M + BLOCK_M - 1) // H + 1)  # last token of the tile + 1
        for k0 in range(0, k_end, BLOCK_N):
            kk = k0 + cols  # new-row index inside the session
            if TREE:
                half = tl.where(k0 < 32, b0, b1)
                if TWO_WORDS:
                    half = tl.where(k0 < 64, half, tl.where(k0 < 96, b2, b3))
                vis = ((half[:, None] >> (kk & 31)[None, :]) & 1) != 0
            else:
                vis = kk[None, :] <= j[:, None]
            m, l, o = _attend(q, qpe, m, l, o, kv_ptr, bt_row, stride_kv, L + kk, kk < k_end,
                              vis & (kk < k_end)[None, :], qk_scale, DL, DR, BDL, BDR, PAGE, True, PREC)
    if nc == 1:
        out = o / tl.where(l == 0.0, 1.0, l)[:, None]  # l == 0 only on padding rows
        tl.store(out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh + dl[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dl < DL)[None, :])
    else:
        part = (part0 + pid_c).to(tl.int64)
        rm = tl.arange(0, BLOCK_M)
        tl.store(po_ptr + part * (BLOCK_M * BDL) + rm[:, None] * BDL + dl[None, :], o)
        tl.store(pml_ptr + part * (2 * BLOCK_M) + rm, m)
        tl.store(pml_ptr + part * (2 * BLOCK_M) + BLOCK_M + rm, l)


@triton.jit
def _mla_combine_kernel(
    po_ptr, pml_ptr,  # partials from _mla_fwd_kernel
    cu_ptr, pre_ptr,
    out_ptr,  # out: [T, H, DL] (rows of single-chunk sessions were written by _mla_fwd_kernel)
    S, H, stride_ot, stride_oh,
    DL: tl.constexpr, BDL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, NCH: tl.constexpr, C_MIN: tl.constexpr, S_PAD: tl.constexpr,
):
    pid_t = tl.program_id(0)
    s, tile, t0, n, L, C, nc, part0 = _tile_session(pid_t, cu_ptr, pre_ptr, S, H, BLOCK_M, NCH, C_MIN,
                                                    BLOCK_N, S_PAD)
    if (s >= S) | (nc == 1):
        return
    rm = tl.arange(0, BLOCK_M)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    o = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for c in range(nc):  # chunk order: fixed
        part = (part0 + c).to(tl.int64)
        mc = tl.load(pml_ptr + part * (2 * BLOCK_M) + rm)
        lc = tl.load(pml_ptr + part * (2 * BLOCK_M) + BLOCK_M + rm)
        oc = tl.load(po_ptr + part * (BLOCK_M * BDL) + rm[:, None] * BDL + d[None, :])
        m_new = tl.maximum(m, mc)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m - m_use)
        b = tl.exp2(mc - m_use)
        l = tl.fma(l, a, lc * b)
        o = tl.fma(o, a[:, None], oc * b[:, None])
        m = m_new
    r = tile * BLOCK_M + rm
    t = (t0 + r // H).to(tl.int64)
    out = o / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(out_ptr + t[:, None] * stride_ot + (r % H)[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(r < n * H)[:, None] & (d < DL)[None, :])
