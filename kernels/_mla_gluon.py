"""Gluon (Hopper) kernel of `kernels.mla_attention`: the split-KV absorbed MLA tile loop with S computed once.

Same work unit, keys, chunks and partials as `_mla_kernels._mla_fwd_kernel` (read its docstring: a query
tile is the 64 heads of one token, a chunk is a `chunk_span` of whole 64-key tiles at absolute positions,
nc == 1 writes the output, else the partials that `_mla_combine_kernel` folds in chunk order). What
differs is how a tile is computed. In the Triton kernel the score GEMM S = q K^T, whose result feeds the
PV GEMM, is laid out with all 8 warps along the 64 query rows, so both warpgroups compute the same S
(53% extra tensor work). Here the layouts are explicit (Gluon):

  S [64, 64]   = Q [64, 576] (shared) x K^T: wgmma with warps [4, 2], each warpgroup 32 of the keys
  softmax      row max / sum across the two warpgroups (the compiler reduces through shared memory)
  P -> shared  bf16 [64, 64], then O [64, 512] += P x V: wgmma with warps [4, 2], each warpgroup owns
               256 of the 512 value columns (its half of the fp32 accumulator: 128 registers/thread)

so every MMA is done once. KV tiles go into a 2-stage shared ring: a chunk's whole tiles of committed rows by
TMA (`BOX` > 0: 64 // BOX runs of contiguous pool rows, a page of 16 or 32 rows or 64 rows of a larger page, each one
2D tensor copy of the latent and one of the rope columns, completing the stage's mbarrier phase), the others
(ragged ends, tree ancestors) gathered through the block table with zero-filling cp.async; the query tile by TMA
too where a token's heads are rows of one 2D view (`QTMA`). Both paths put the same bytes in the same layout, so
the bits do not depend on them. Per tile the PV product and the next tile's S go to the tensor cores back to back,
the copies run one tile ahead and the block-table loads two. Every
tile, hot or ragged, runs the same code with a runtime mask (masked rows are zero-filled and their
scores are -inf), so the result of a row depends only on its position and keys: batch invariance and
position alignment hold as in the Triton kernel. The two kernels do not give the same bits as each
other (different MMA shapes); a deployment uses one (`mla_attention_triton(impl=)`).

Fixed shapes: 64 heads per tile, latent 512 + rope 64, 64-key tiles, bf16 or fp16, 8 warps, sm_90.
Shared memory: Q 72 KB + 2 x 72 KB KV stages + P 8 KB = 224 KB (one CTA per SM).
"""

from __future__ import annotations

import functools

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel is the only path
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from kernels._gluon_compat import cp_async as _cp_async
    from kernels._gluon_compat import cta_barrier as _cta_barrier
    from kernels._gluon_compat import tma_load as _tma_load
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

from kernels._mla_kernels import chunk_span

GLUON_BLOCK_M = 64
GLUON_BLOCK_N = 64
GLUON_DL = 512
GLUON_DR = 64
GLUON_WARPS = 8
GLUON_STAGES = 2
GLUON_TMA = True  # whole committed tiles by TMA where `tma_box_rows` allows (same data, same bits as cp.async)


TMA_MAX_BOXES = 4  # page runs per 64-key tile the TMA path loads (pages of 16 rows and more)


def tma_box_rows(page_size: int) -> int:
    """Rows of one TMA box: a 64-key tile (at an absolute multiple of 64) is 64 // box runs of contiguous pool
    rows, a page each (or one run inside a larger page); 0 where the TMA path does not apply."""
    if page_size % GLUON_BLOCK_N == 0:
        return GLUON_BLOCK_N
    if GLUON_BLOCK_N % page_size == 0 and GLUON_BLOCK_N // page_size <= TMA_MAX_BOXES:
        return page_size
    return 0


@functools.cache
def _tile_layout(cols: int):
    """The shared layout of a [64, cols] 16-bit tile (the query tile's, the stages' and so the TMA boxes'): it depends
    on the element width only, the same for the bf16 and fp16 caches the kernel takes; made once (a launch without a
    CUDA graph builds its descriptors every call)."""
    return gl.NVMMASharedLayout.get_default_for([GLUON_BLOCK_N, cols], gl.bfloat16)


def q_descriptors(q_lat, q_pe):
    """TMA descriptors of one token's 64-head query tile ([64, DL] and [64, DR] boxes of the [T * H, .] views), or
    None where the heads of a token are not rows of one 2D view with 16-byte aligned rows (the kernel then loads
    the tile with plain loads)."""
    T, H, _ = q_lat.shape
    views = []
    for t, cols in ((q_lat, GLUON_DL), (q_pe, GLUON_DR)):
        if t.stride(0) != H * t.stride(1) or t.stride(1) % 8 or t.data_ptr() % 16 or t.stride(2) != 1:
            return None
        flat = t.as_strided((T * H, cols), (t.stride(1), 1))
        views.append(TensorDescriptor(flat, [T * H, cols], [t.stride(1), 1], [GLUON_BLOCK_M, cols],
                                      _tile_layout(cols)))
    return tuple(views)


def kv_descriptors(kv_cache, box: int):
    """TMA descriptors of the flat pool [slots, DL + DR] for `box` rows of a tile's latent [box, DL] and rope
    [box, DR] columns, in the shared layouts the kernel's stages have (a box lands in rows of a stage)."""
    shape, strides = list(kv_cache.shape), list(kv_cache.stride())
    return (TensorDescriptor(kv_cache, shape, strides, [box, GLUON_DL], _tile_layout(GLUON_DL)),
            TensorDescriptor(kv_cache, shape, strides, [box, GLUON_DR], _tile_layout(GLUON_DR)))

if HAVE_GLUON:
    # the tile kernels' register layouts (8 warps; shared by `_mla_gluon_persistent`)
    _L1 = gl.constexpr(gl.BlockedLayout([1], [32], [8], [0]))
    _LB2 = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [8, 1], [1, 0]))  # [BLOCK_N, NB] tree lookups
    _LKV = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]))  # [rows, 512]: 16-byte copies
    _LPE = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))  # [rows, 64]
    _S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]))
    _O_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]))

    def fragment_store_layout(cols: int, warps_n: int):
        """The layout of a 16-bit partial O [64, cols] in fragment order (`_store_partial`), distributed as the
        wgmma accumulator it came from (4 warps along the rows, `warps_n` along the columns, m64 instructions of
        cols / warps_n columns) but with a thread's four values of a 16-column group in consecutive registers, so
        they go out as one 8-byte store: registers cols 1, 2, then row 8, then the thread's next 16-column groups;
        lanes cols 4, 8 and rows 1, 2, 4; warps rows 16, 32, then the column blocks."""
        n = cols // warps_n
        reg = [[0, 1], [0, 2], [8, 0]] + [[0, 16 << i] for i in range((n // 16).bit_length() - 1)]
        warp = [[16, 0], [32, 0]] + [[0, n << i] for i in range(warps_n.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                          warp_bases=warp, block_bases=[], shape=[64, cols])

    _ST_L = gl.constexpr(fragment_store_layout(GLUON_DL, 2))  # the grid and persistent kernels' O
    _ST_HALF_L = gl.constexpr(fragment_store_layout(GLUON_DL // 2, 1))  # one warpgroup's half (ws, seesaw)

    @gluon.jit
    def _session_of(t, cu_ptr, S, S_PAD: gl.constexpr, L1: gl.constexpr):
        # sessions that end at or before token t = the session of t
        offs = gl.arange(0, S_PAD, layout=L1)
        hi = gl.load(cu_ptr + offs + 1, mask=offs < S, other=2147483647)
        return gl.sum((hi <= t).to(gl.int32), 0)

    @gluon.jit
    def _item_query(pid_t, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, S_PAD: gl.constexpr, TREE: gl.constexpr,
                    NB: gl.constexpr, L1: gl.constexpr, LB2: gl.constexpr):
        """Query tile pid_t's token t, session s, prefix L, ancestor bits [NB] (layout SliceLayout(0, LB2); all 0
        when causal) and position p (as _mla_kernels._query_row)."""
        t = pid_t // HT
        s = _session_of(t, cu_ptr, S, S_PAD, L1)
        L = gl.load(pre_ptr + s)
        kk = gl.arange(0, NB, layout=gl.SliceLayout(0, LB2))
        if TREE:
            w = gl.load(bits_ptr + t.to(gl.int64) * stride_bits + kk // 64)
            bit = ((w >> (kk % 64).to(gl.int64)) & 1).to(gl.int32)
            p = L + gl.sum(bit, 0) - 1
        else:
            bit = gl.zeros([NB], gl.int32, layout=gl.SliceLayout(0, LB2))
            p = L + t - gl.load(cu_ptr + s)
        return t, s, L, bit, p

    @gluon.jit
    def _ancestor_ranks(bit, NB: gl.constexpr, TREE: gl.constexpr, LB2: gl.constexpr):
        """Depth of each ancestor (where bit is set) = the set bits before it ([NB, NB] sum, once per query row);
        `bit` itself when causal (unused there)."""
        if TREE:
            kk = gl.arange(0, NB, layout=gl.SliceLayout(0, LB2))
            kr = gl.arange(0, NB, layout=gl.SliceLayout(1, LB2))
            below = gl.expand_dims(kk, 0) < gl.expand_dims(kr, 1)
            return gl.convert_layout(gl.sum(gl.where(below, gl.expand_dims(bit, 0), 0), 1), gl.SliceLayout(0, LB2))
        else:
            return bit

    @gluon.jit
    def _check_box(BOX: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
        """BOX > 0: whole committed tiles by TMA, as runs of BOX contiguous pool rows (a page, or a tile in a page)."""
        gl.static_assert(BOX == 0 or (BOX % 8 == 0 and (PAGE % BLOCK_N == 0 if BOX == BLOCK_N else BOX == PAGE)
                                      and BLOCK_N // BOX <= 4))

    @gluon.jit
    def _issue_q(t, hb, H, q_smem, qpe_smem, q_bar, desc_q, desc_qpe, BLOCK_M: gl.constexpr):
        """A query tile (token t's heads hb * 64 .., rows t * H + hb * 64 .. of the [T * H, .] views) by TMA, on
        q_bar."""
        mbarrier.expect(q_bar, desc_q.block_type.nbytes + desc_qpe.block_type.nbytes)
        _tma_load(desc_q, [t * H + hb * BLOCK_M, 0], q_bar, q_smem)
        _tma_load(desc_qpe, [t * H + hb * BLOCK_M, 0], q_bar, qpe_smem)

    @gluon.jit
    def _store_partial(po_ptr, part, o, BLOCK_M: gl.constexpr, DL: gl.constexpr, COLS: gl.constexpr, C_OFF,
                       O_L: gl.constexpr, ST_L: gl.constexpr):
        """o [BLOCK_M, COLS] (layout O_L, a wgmma accumulator) -> columns C_OFF.. of partial `part` (C_OFF a multiple of
        16; a constant, or a program's column part in the seesaw kernel's value split). fp32 as laid
        out (a thread's two adjacent values: 8 bytes). 16-bit in fragment order (`_mla_kernels._fragment_col`):
        each 16-column group stored with a thread's two pairs, 8 columns apart in O, side by side, so a thread
        writes 8 bytes and four threads a 32-byte sector (plain order would take twice the 4-byte stores); a
        reshape and permute of the logical tensor, then a register-only change of layout (ST_L)."""
        if po_ptr.dtype.element_ty.primitive_bitwidth == 16:
            v = gl.reshape(o.to(po_ptr.dtype.element_ty), [BLOCK_M, COLS // 16, 2, 4, 2])  # [r, g, jb, q, e]
            v = gl.convert_layout(gl.reshape(gl.permute(v, [0, 1, 3, 2, 4]), [BLOCK_M, COLS]), ST_L)
            rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ST_L))
            dl = gl.arange(0, COLS, layout=gl.SliceLayout(0, ST_L))
        else:
            v = o.to(po_ptr.dtype.element_ty)
            rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_L))
            dl = gl.arange(0, COLS, layout=gl.SliceLayout(0, O_L))
        gl.store(po_ptr + part * (BLOCK_M * DL) + gl.expand_dims(rm * DL, 1) + C_OFF + gl.expand_dims(dl, 0), v)

    @gluon.jit
    def _fold_chunk(o, m, li, m_run, l_run, o_run, have_run, last, out_ptr, t64, hb, H, stride_ot,
                    stride_oh, ROUND: gl.constexpr, BLOCK_M: gl.constexpr, DL: gl.constexpr, O_L: gl.constexpr):
        """A chunk's (m, l, O) folded into the running (m_run, l_run, O at o_run [64, DL] fp32) with the combine
        kernel's arithmetic (`_mla_kernels._fold`; O first rounded to the output's dtype when ROUND, as a 16-bit
        partial is): the running O read back unless this is the first chunk (have_run false: it folds into +0.0, as
        the combine's first chunk does), then written back, or (last) divided by l and written to the output.
        -> (m_run, l_run)."""
        if ROUND:
            o = o.to(out_ptr.dtype.element_ty).to(gl.float32)
        m_new = gl.maximum(m_run, m)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        a = gl.exp2(m_run - m_use)
        b = gl.exp2(m - m_use)
        l_new = gl.fma(l_run, a, li * b)
        rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_L))
        dl = gl.arange(0, DL, layout=gl.SliceLayout(0, O_L))
        at = gl.expand_dims(rm * DL, 1) + gl.expand_dims(dl, 0)
        a2 = gl.expand_dims(gl.convert_layout(a, gl.SliceLayout(1, O_L)), 1)
        ob = o * gl.expand_dims(gl.convert_layout(b, gl.SliceLayout(1, O_L)), 1)
        prev = gl.load(o_run + at, mask=(at >= 0) & have_run, other=0.0)  # the first chunk folds into +0.0
        o_new = gl.fma(prev, a2, ob)
        if last:
            lo = gl.convert_layout(l_new, gl.SliceLayout(1, O_L))
            out = o_new / gl.expand_dims(gl.where(lo == 0.0, 1.0, lo), 1)
            h = hb * BLOCK_M + rm
            gl.store(out_ptr + t64 * stride_ot + gl.expand_dims(h * stride_oh, 1) + gl.expand_dims(dl, 0),
                     out.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(h < H, 1) & gl.expand_dims(dl < DL, 0))
        else:
            gl.store(o_run + at, o_new)
        return m_new, l_new

    @gluon.jit
    def _store_item(o, m, li, pid_t, pid_c, nc, HT, GC, out_ptr, po_ptr, pml_ptr, stride_ot, stride_oh, H,
                    BLOCK_M: gl.constexpr, DL: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr):
        """A finished (query tile, chunk): the output when the row has one chunk, else the partial (o in po's dtype,
        m and l in fp32) that `_mla_combine_kernel` folds."""
        rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_L))
        dl = gl.arange(0, DL, layout=gl.SliceLayout(0, O_L))
        if nc == 1:
            lo = gl.convert_layout(li, gl.SliceLayout(1, O_L))
            out = o / gl.expand_dims(gl.where(lo == 0.0, 1.0, lo), 1)  # l == 0 only for a row that sees nothing
            h = (pid_t % HT) * BLOCK_M + rm
            t64 = (pid_t // HT).to(gl.int64)
            gl.store(out_ptr + t64 * stride_ot + gl.expand_dims(h * stride_oh, 1) + gl.expand_dims(dl, 0),
                     out.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(h < H, 1) & gl.expand_dims(dl < DL, 0))
        else:
            part = (pid_t * GC + pid_c).to(gl.int64)
            _store_partial(po_ptr, part, o, BLOCK_M, DL, DL, 0, O_L, _ST_L)
            rs = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L))
            gl.store(pml_ptr + part * (2 * BLOCK_M) + rs, m)
            gl.store(pml_ptr + part * (2 * BLOCK_M) + BLOCK_M + rs, li)

    @gluon.jit
    def _tile_rows(k0, start, end, ident, L, bit, rank, bt_row, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                   NB: gl.constexpr, TREE: gl.constexpr, LR: gl.constexpr, LB2: gl.constexpr):
        """Physical pool rows [BLOCK_N] (layout LR) of the tile at positions k0.. and which of them count."""
        pos = k0 + gl.arange(0, BLOCK_N, layout=LR)
        valid = (pos >= start) & (pos < end)
        idx = pos
        if TREE:
            if k0 + BLOCK_N > ident:  # the tile reaches into the tree part: ancestors by depth
                e = pos - L
                e2 = gl.convert_layout(e, gl.SliceLayout(1, LB2))
                kk = gl.arange(0, NB, layout=gl.SliceLayout(0, LB2))
                hit = (gl.expand_dims(bit, 0) != 0) & (gl.expand_dims(rank, 0) == gl.expand_dims(e2, 1))
                anc = gl.sum(gl.where(hit, gl.expand_dims(kk, 0), 0), 1)
                idx = gl.where(e >= 0, L + gl.convert_layout(anc, LR), pos)
        page = gl.load(bt_row + idx // PAGE, mask=valid, other=0)
        return (page.to(gl.int64) * PAGE + idx % PAGE), valid

    @gluon.jit
    def _page_row(k0, q: gl.constexpr, end, bt_row, PAGE: gl.constexpr, BOX: gl.constexpr):
        """Pool row of position k0 + q * BOX (a box's first row; 0 for a box the tile does not have)."""
        if q * BOX < 64:
            pos = k0 + q * BOX
            page = gl.load(bt_row + pos // PAGE, mask=pos < end, other=0)
            return page * PAGE + pos % PAGE
        else:
            return 0

    @gluon.jit
    def _tile_boxes(k0, end, bt_row, PAGE: gl.constexpr, BOX: gl.constexpr):
        """A TMA tile's coordinates: the first pool row of each of its 64 // BOX runs of contiguous rows (up to 4;
        the unused ones 0); all 0 without TMA (BOX == 0)."""
        if BOX > 0:
            return (_page_row(k0, 0, end, bt_row, PAGE, BOX), _page_row(k0, 1, end, bt_row, PAGE, BOX),
                    _page_row(k0, 2, end, bt_row, PAGE, BOX), _page_row(k0, 3, end, bt_row, PAGE, BOX))
        else:
            return 0, 0, 0, 0

    @gluon.jit
    def _load_tile(j, n_tma, boxes, kv_ptr, stride_kv, rows, valid, ckv_buf, kpe_buf, bar, desc_l, desc_r,
                   DL: gl.constexpr, DR: gl.constexpr, BOX: gl.constexpr, LKV: gl.constexpr, LPE: gl.constexpr):
        """Tile j into one stage: by TMA when it is one of the chunk's first n_tma tiles (whole, committed rows,
        64 // BOX runs of BOX contiguous pool rows at `boxes`, arriving on `bar`), else by cp.async (gathered or
        ragged rows, zero-filled)."""
        if BOX > 0 and j < n_tma:
            _tma_tile(boxes, ckv_buf, kpe_buf, bar, desc_l, desc_r, DL, BOX)
        else:
            _issue_tile(kv_ptr, stride_kv, rows, valid, ckv_buf, kpe_buf, DL, DR, LKV, LPE)

    @gluon.jit
    def _tma_tile(boxes, ckv_buf, kpe_buf, bar, desc_l, desc_r, DL: gl.constexpr, BOX: gl.constexpr):
        """A whole committed tile into one stage by TMA: 64 // BOX runs of BOX pool rows from `boxes`, on `bar`."""
        NBOX: gl.constexpr = 64 // BOX if BOX > 0 else 1
        mbarrier.expect(bar, NBOX * (desc_l.block_type.nbytes + desc_r.block_type.nbytes))
        for q in gl.static_range(NBOX):
            _tma_load(desc_l, [boxes[q], 0], bar, ckv_buf.slice(q * BOX, BOX))
            _tma_load(desc_r, [boxes[q], DL], bar, kpe_buf.slice(q * BOX, BOX))

    @gluon.jit
    def _wait_tile(j, n_tma, bars, N_CP: gl.constexpr, STAGES: gl.constexpr):
        """Wait for tile j (at most N_CP cp.async groups still in flight): its TMA phase (tile j is the
        (j // STAGES)-th TMA load of its stage: TMA tiles are a chunk's first), then make it visible to wgmma."""
        cp.wait_group(N_CP)
        if j < n_tma:
            mbarrier.wait(bars.index(j % STAGES), (j // STAGES) & 1)
        fence_async_shared()
        _cta_barrier()

    @gluon.jit
    def _issue_tile(kv_ptr, stride_kv, rows, valid, ckv_buf, kpe_buf, DL: gl.constexpr, DR: gl.constexpr,
                    LKV: gl.constexpr, LPE: gl.constexpr):
        # cp.async the tile's latent and rope columns into one stage; masked rows are zero-filled
        r1 = gl.convert_layout(rows, gl.SliceLayout(1, LKV))
        v1 = gl.convert_layout(valid, gl.SliceLayout(1, LKV))
        c1 = gl.arange(0, DL, layout=gl.SliceLayout(0, LKV))
        p1 = kv_ptr + gl.expand_dims(r1 * stride_kv, 1) + gl.expand_dims(c1, 0)
        _cp_async(ckv_buf, p1, mask=gl.expand_dims(v1, 1) & gl.expand_dims(c1 < DL, 0))
        r2 = gl.convert_layout(rows, gl.SliceLayout(1, LPE))
        v2 = gl.convert_layout(valid, gl.SliceLayout(1, LPE))
        c2 = gl.arange(0, DR, layout=gl.SliceLayout(0, LPE))
        p2 = kv_ptr + gl.expand_dims(r2 * stride_kv, 1) + DL + gl.expand_dims(c2, 0)
        _cp_async(kpe_buf, p2, mask=gl.expand_dims(v2, 1) & gl.expand_dims(c2 < DR, 0))

    @gluon.jit
    def _softmax_tile(sc, m, li, pos, end, qk_scale):
        """Online softmax of one tile's scores (keys at positions pos [BLOCK_N], seen where pos < end), in
        base 2: -> (m, l, P, alpha), O to be rescaled by alpha before P's product is added."""
        sc = gl.where(gl.expand_dims(pos < end, 0), sc * qk_scale, float("-inf"))  # log2 domain
        m_new = gl.maximum(m, gl.max(sc, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        pr = gl.exp2(sc - gl.expand_dims(m_use, 1))
        alpha = gl.exp2(m - m_use)
        return m_new, gl.fma(li, alpha, gl.sum(pr, 1)), pr, alpha

    @gluon.jit
    def _issue_first_tiles(start, end, n_tma, bt_row, desc_l, desc_r, ckv_smem, kpe_smem, bars, DL: gl.constexpr,
                           PAGE: gl.constexpr, BLOCK_N: gl.constexpr, BOX: gl.constexpr):
        """A chunk's tiles 0 and 1 by TMA into stages 0 and 1, those of them that are TMA tiles (n_tma)."""
        if n_tma > 0:
            _tma_tile(_tile_boxes(start, end, bt_row, PAGE, BOX), ckv_smem.index(0), kpe_smem.index(0),
                      bars.index(0), desc_l, desc_r, DL, BOX)
        if n_tma > 1:
            _tma_tile(_tile_boxes(start + BLOCK_N, end, bt_row, PAGE, BOX), ckv_smem.index(1),
                      kpe_smem.index(1), bars.index(1), desc_l, desc_r, DL, BOX)

    @gluon.jit
    def _chunk_o(start, end, ident, n_tma, L, bit, bt_row, t64, hb, H, q_ptr, qpe_ptr, kv_ptr, stride_qt, stride_qh,
                 stride_pt, stride_ph, stride_kv, qk_scale, desc_l, desc_r, q_smem, qpe_smem, ckv_smem, kpe_smem,
                 p_smem, bars, load_q, tma_issued, DL: gl.constexpr, DR: gl.constexpr, PAGE: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TREE: gl.constexpr, NB: gl.constexpr,
                 STAGES: gl.constexpr, BOX: gl.constexpr, QTMA: gl.constexpr):
        """(m, l, O) of the query tile over the keys at positions [start, end) (the chunk), from a fresh state: the
        KV tiles through the STAGES-stage ring (the first n_tma by TMA on bars[stage], fresh barriers), returned
        after the last copy has landed. load_q: the query tile is waited for (QTMA, on bars[STAGES]) or loaded here,
        between the first tiles' copies and the first S (a literal True in the split kernel: no branch).
        tma_issued: the chunk's first two TMA tiles are already in flight (`_issue_first_tiles`; a literal False in
        the split kernel)."""
        dt: gl.constexpr = kv_ptr.dtype.element_ty
        n_tiles = (end - start + BLOCK_N - 1) // BLOCK_N
        # prologue: tiles 0 and 1 in flight (TMA ones first: they need no ancestor ranks), tile 2's pool rows
        # looked up (used at the end of iteration 0)
        if BOX > 0 and not tma_issued:
            _issue_first_tiles(start, end, n_tma, bt_row, desc_l, desc_r, ckv_smem, kpe_smem, bars, DL, PAGE,
                               BLOCK_N, BOX)
        rank = _ancestor_ranks(bit, NB, TREE, _LB2)
        rows, valid = _tile_rows(start, start, end, ident, L, bit, rank, bt_row, PAGE, BLOCK_N, NB, TREE, _L1, _LB2)
        if n_tma <= 0:
            _issue_tile(kv_ptr, stride_kv, rows, valid, ckv_smem.index(0), kpe_smem.index(0), DL, DR, _LKV, _LPE)
        cp.commit_group()
        if n_tiles > 1:
            rows, valid = _tile_rows(start + BLOCK_N, start, end, ident, L, bit, rank, bt_row, PAGE, BLOCK_N, NB,
                                     TREE, _L1, _LB2)
            if n_tma <= 1:
                _issue_tile(kv_ptr, stride_kv, rows, valid, ckv_smem.index(1), kpe_smem.index(1), DL, DR, _LKV, _LPE)
        cp.commit_group()
        boxes = _tile_boxes(start, end, bt_row, PAGE, BOX)  # (defined for the loop; tile 2's are looked up next)
        if n_tiles > 2:
            rows, valid = _tile_rows(start + 2 * BLOCK_N, start, end, ident, L, bit, rank, bt_row, PAGE, BLOCK_N,
                                     NB, TREE, _L1, _LB2)
            boxes = _tile_boxes(start + 2 * BLOCK_N, end, bt_row, PAGE, BOX)

        if not load_q:
            pass
        elif QTMA:
            mbarrier.wait(bars.index(STAGES), 0)
        else:
            h1 = hb * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, _LKV))
            c1 = gl.arange(0, DL, layout=gl.SliceLayout(0, _LKV))
            q = gl.load(q_ptr + t64 * stride_qt + gl.expand_dims(h1 * stride_qh, 1) + gl.expand_dims(c1, 0),
                        mask=gl.expand_dims(h1 < H, 1) & gl.expand_dims(c1 < DL, 0), other=0.0)
            q_smem.store(q.to(dt))
            h2 = hb * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, _LPE))
            c2 = gl.arange(0, DR, layout=gl.SliceLayout(0, _LPE))
            qpe = gl.load(qpe_ptr + t64 * stride_pt + gl.expand_dims(h2 * stride_ph, 1) + gl.expand_dims(c2, 0),
                          mask=gl.expand_dims(h2 < H, 1) & gl.expand_dims(c2 < DR, 0), other=0.0)
            qpe_smem.store(qpe.to(dt))

        m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, _S_L))
        li = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, _S_L))
        o = gl.zeros([BLOCK_M, DL], gl.float32, layout=_O_L)
        cols_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, _S_L))
        _wait_tile(0, n_tma, bars, 1, STAGES)  # tile 0 landed
        sc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=_S_L)
        sc = warpgroup_mma(q_smem, ckv_smem.index(0).permute((1, 0)), sc, use_acc=False, is_async=True)
        sc = warpgroup_mma(qpe_smem, kpe_smem.index(0).permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        # iteration j: softmax of S_j, then O += P_j V_j and S_{j+1} = Q K_{j+1}^T back to back on the tensor
        # cores (one wait for both); then tile j + 2's copies go into the freed stage and tile j + 3's pool rows
        # are looked up, so neither the copies nor the block-table loads wait in line
        for j in range(n_tiles):
            m, li, pr, alpha = _softmax_tile(sc, m, li, start + j * BLOCK_N + cols_s, end, qk_scale)
            p_smem.store(pr.to(dt))
            fence_async_shared()
            _cta_barrier()
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, _O_L)), 1)
            o = warpgroup_mma(p_smem, ckv_smem.index(j % STAGES), o, is_async=True)
            if j + 1 < n_tiles:
                _wait_tile(j + 1, n_tma, bars, 0, STAGES)  # tile j + 1 landed (the only group in flight)
                nxt = (j + 1) % STAGES
                sc = warpgroup_mma(q_smem, ckv_smem.index(nxt).permute((1, 0)), sc, use_acc=False, is_async=True)
                sc = warpgroup_mma(qpe_smem, kpe_smem.index(nxt).permute((1, 0)), sc, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))  # (an async result cannot leave the if)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            _cta_barrier()  # every warp is done with stage j and P before they are rewritten
            if j + 2 < n_tiles:
                _load_tile(j + 2, n_tma, boxes, kv_ptr, stride_kv, rows, valid, ckv_smem.index(j % STAGES),
                           kpe_smem.index(j % STAGES), bars.index(j % STAGES), desc_l, desc_r, DL, DR, BOX, _LKV,
                           _LPE)
            cp.commit_group()
            if j + 3 < n_tiles:
                if j + 3 >= n_tma:  # a cp.async tile: its pool rows (a TMA tile needs only its boxes)
                    rows, valid = _tile_rows(start + (j + 3) * BLOCK_N, start, end, ident, L, bit, rank, bt_row,
                                             PAGE, BLOCK_N, NB, TREE, _L1, _LB2)
                boxes = _tile_boxes(start + (j + 3) * BLOCK_N, end, bt_row, PAGE, BOX)
        cp.wait_group(0)
        return m, li, o

    @gluon.jit
    def _mla_fwd_gluon_kernel(
        q_ptr, qpe_ptr, kv_ptr, bt_ptr, cu_ptr, pre_ptr, bits_ptr, out_ptr, po_ptr, pml_ptr, nc_ptr, desc_l, desc_r,
        desc_q, desc_qpe,
        S, H, HT, GC, qk_scale,
        stride_qt, stride_qh, stride_pt, stride_ph, stride_kv, stride_bt, stride_bits, stride_ot, stride_oh,
        DL: gl.constexpr, DR: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        NCH: gl.constexpr, C_MIN: gl.constexpr, RULE: gl.constexpr, S_PAD: gl.constexpr, TREE: gl.constexpr,
        NB: gl.constexpr, STAGES: gl.constexpr, BOX: gl.constexpr, QTMA: gl.constexpr, FOLD: gl.constexpr = False,
        ROUND: gl.constexpr = False,
    ):
        """One (query tile, chunk) per program (grid [tiles, chunks]); FOLD (grid [tiles, 1]): one program per query
        tile, its chunks one after the other, each chunk's O rounded to the output's dtype when ROUND (as 16-bit
        partials are) and folded with the combine kernel's arithmetic into a running O kept in `po` (fp32, one
        [64, 512] row per query tile; L2-resident while its program runs): the split launch's bits
        (`_mla_kernels._fold`)."""
        gl.static_assert(BLOCK_M == 64 and BLOCK_N == 64 and DL == 512 and DR == 64)
        _check_box(BOX, PAGE, BLOCK_N)
        gl.static_assert(gl.num_warps() == 8)
        dt: gl.constexpr = kv_ptr.dtype.element_ty
        SH_KV: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], dt)
        SH_PE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], dt)
        SH_P: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dt)

        # --- which query row and chunk (as _mla_kernels._query_row) ---
        pid_t = gl.program_id(0)
        pid_c = gl.program_id(1)
        hb = pid_t % HT
        t, s, L, bit, p = _item_query(pid_t, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, S_PAD, TREE, NB, _L1, _LB2)
        nc, start, end = chunk_span(p + 1, pid_c, RULE, BLOCK_N, NCH, C_MIN)
        if pid_c == 0:
            gl.store(nc_ptr + pid_t, nc)
        if pid_c >= nc:
            return
        if TREE:
            ident = gl.minimum(end, L)
        else:
            ident = end
        bt_row = bt_ptr + s.to(gl.int64) * stride_bt
        t64 = t.to(gl.int64)
        if BOX > 0:  # the chunk's first tiles whose keys are all committed rows (identity-mapped, all visible)
            n_tma = gl.maximum(ident - start, 0) // BLOCK_N
        else:
            n_tma = 0

        # --- shared memory: Q once, a ring of KV stages, P ---
        q_smem = gl.allocate_shared_memory(dt, [BLOCK_M, DL], SH_KV)
        qpe_smem = gl.allocate_shared_memory(dt, [BLOCK_M, DR], SH_PE)
        ckv_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DL], SH_KV)
        kpe_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DR], SH_PE)
        p_smem = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N], SH_P)
        # TMA arrivals: bars[s] the tiles of stage s, bars[STAGES] the query tile
        bars = gl.allocate_shared_memory(gl.int64, [STAGES + 1, 1], mbarrier.MBarrierLayout())
        if BOX > 0 or QTMA:
            for i in gl.static_range(STAGES + 1):
                mbarrier.init(bars.index(i), count=1)
            fence_async_shared()
        if QTMA:  # the token's 64 heads while the tiles load
            _issue_q(t, hb, H, q_smem, qpe_smem, bars.index(STAGES), desc_q, desc_qpe, BLOCK_M)

        if FOLD:  # every chunk of the tile in order (one code path: the running O stays out of the tile loop)
            o_run = po_ptr + pid_t.to(gl.int64) * (BLOCK_M * DL)  # this tile's running O
            m_run = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, _S_L))
            l_run = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, _S_L))
            for c in range(nc):
                m, li, o = _chunk_o(start, end, ident, n_tma, L, bit, bt_row, t64, hb, H, q_ptr, qpe_ptr, kv_ptr,
                                    stride_qt, stride_qh, stride_pt, stride_ph, stride_kv, qk_scale, desc_l, desc_r,
                                    q_smem, qpe_smem, ckv_smem, kpe_smem, p_smem, bars, c == 0, c > 0, DL, DR, PAGE,
                                    BLOCK_M, BLOCK_N, TREE, NB, STAGES, BOX, QTMA)
                if c + 1 < nc:  # the next chunk's first TMA tiles in flight while this one is folded
                    _cta_barrier()  # every warp is past its last wait on the stage barriers before they are made anew
                    _, start, end = chunk_span(p + 1, c + 1, RULE, BLOCK_N, NCH, C_MIN)
                    if TREE:
                        ident = gl.minimum(end, L)
                    else:
                        ident = end
                    if BOX > 0:
                        for i in gl.static_range(STAGES):
                            mbarrier.invalidate(bars.index(i))
                            mbarrier.init(bars.index(i), count=1)
                        fence_async_shared()
                        n_tma = gl.maximum(ident - start, 0) // BLOCK_N
                        _issue_first_tiles(start, end, n_tma, bt_row, desc_l, desc_r, ckv_smem, kpe_smem, bars, DL,
                                           PAGE, BLOCK_N, BOX)
                if nc == 1:
                    _store_item(o, m, li, pid_t, 0, 1, HT, GC, out_ptr, po_ptr, pml_ptr, stride_ot, stride_oh, H,
                                BLOCK_M, DL, _S_L, _O_L)
                else:
                    m_run, l_run = _fold_chunk(o, m, li, m_run, l_run, o_run, c > 0, c == nc - 1, out_ptr, t64, hb,
                                               H, stride_ot, stride_oh, ROUND, BLOCK_M, DL, _O_L)
            if BOX > 0 or QTMA:
                for i in gl.static_range(STAGES + 1):
                    mbarrier.invalidate(bars.index(i))
        else:
            m, li, o = _chunk_o(start, end, ident, n_tma, L, bit, bt_row, t64, hb, H, q_ptr, qpe_ptr, kv_ptr,
                                stride_qt, stride_qh, stride_pt, stride_ph, stride_kv, qk_scale, desc_l, desc_r,
                                q_smem, qpe_smem, ckv_smem, kpe_smem, p_smem, bars, True, False, DL, DR, PAGE, BLOCK_M,
                                BLOCK_N, TREE, NB, STAGES, BOX, QTMA)
            if BOX > 0 or QTMA:
                for i in gl.static_range(STAGES + 1):
                    mbarrier.invalidate(bars.index(i))
            _store_item(o, m, li, pid_t, pid_c, nc, HT, GC, out_ptr, po_ptr, pml_ptr, stride_ot, stride_oh, H,
                        BLOCK_M, DL, _S_L, _O_L)
