"""Persistent form of the Gluon MLA kernel (`_mla_gluon`): one program per SM walks its share of the work items
and runs their tiles as one stream, so a chunk's fixed cost overlaps the tiles around it.

The work items are `_mla_gluon`'s: (query tile, KV chunk), item w = pid_c * tiles + pid_t (the order the
non-persistent grid runs them in), program k takes w = k, k + NPROG, ... and skips the empty ones (pid_c >= nc)
and, without looking, every item of a chunk index no row of the launch reaches. Every tile is computed by the
same code on the same bytes in the same order as in `_mla_gluon` (the same softmax, MMAs, masks and partials),
so **the bits are those of the non-persistent kernel**; only when things happen changes:

- the loads run two tiles ahead across item boundaries: the last tiles of an item overlap the next item's first
  copies, its query tile (issued by TMA once the previous item's last S is done, a whole tile before it is needed)
  and the lookups of its session, prefix and block table;
- the per-launch costs (a CTA's start, barrier setup, the first tiles' latency) are paid once per SM, not once per
  (token, chunk).

Item state lives in registers: the loader's (the item whose tile is copied next, its ancestor ranks, the next
tile's pool rows), the computer's (the item whose tile is in S) and one pending record (an item whose first tile
is loaded and whose S has not started: the loader runs two tiles ahead and pops happen before pushes, so one is
enough). TMA completions on the two stage barriers are counted per stage (phase = count & 1), the query tile's
per item; cp.async groups are committed one per tile issue as in `_mla_gluon`.

Needs the query tile by TMA (the launcher uses `_mla_gluon` where a token's heads are not rows of one 2D view).
Shared memory as `_mla_gluon` (224 KB, one program per SM).
"""

from __future__ import annotations

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

    from kernels._gluon_compat import cta_barrier as _cta_barrier
    from kernels._gluon_compat import tma_load as _tma_load
    from kernels._mla_gluon import (
        _item_query,
        _load_tile,
        _softmax_tile,
        _store_item,
        _tile_boxes,
        _tile_rows,
    )
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

from kernels._mla_kernels import chunk_span

GLUON_PERSISTENT = False  # opt-in until it has run on a GPU (written in a session without one; same bits by design)

if HAVE_GLUON:

    @gluon.jit
    def _find_item(w, TILES, TOTAL, NPROG, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, RULE: gl.constexpr,
                   BLOCK_N: gl.constexpr, NCH: gl.constexpr, C_MIN: gl.constexpr, S_PAD: gl.constexpr,
                   TREE: gl.constexpr, NB: gl.constexpr, L1: gl.constexpr, LB2: gl.constexpr):
        """The first non-empty item at w, w + NPROG, ... (w >= TOTAL: none): (w, pid_t, pid_c, t, s, L, bit, nc,
        start, end); an item past TOTAL has nc = 0."""
        pid_t = w % TILES
        pid_c = w // TILES
        t, s, L, bit, p = _item_query(pid_t, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, S_PAD, TREE, NB, L1,
                                      LB2)
        nc, start, end = chunk_span(p + 1, pid_c, RULE, BLOCK_N, NCH, C_MIN)
        while (w < TOTAL) & (pid_c >= nc):
            w += NPROG
            pid_t = w % TILES
            pid_c = w // TILES
            t, s, L, bit, p = _item_query(pid_t, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, S_PAD, TREE, NB,
                                          L1, LB2)
            nc, start, end = chunk_span(p + 1, pid_c, RULE, BLOCK_N, NCH, C_MIN)
        nc = gl.where(w < TOTAL, nc, 0)
        return w, pid_t, pid_c, t, s, L, bit, nc, start, end

    @gluon.jit
    def _item_loads(s, L, bit, start, end, bt_ptr, stride_bt, BLOCK_N: gl.constexpr, TREE: gl.constexpr,
                    NB: gl.constexpr, BOX: gl.constexpr, LB2: gl.constexpr):
        """What the loader needs of an item: (ident, n_tma, n_tiles, bt_row, rank) as `_mla_gluon`'s prologue."""
        if TREE:
            ident = gl.minimum(end, L)
            kk = gl.arange(0, NB, layout=gl.SliceLayout(0, LB2))
            kr = gl.arange(0, NB, layout=gl.SliceLayout(1, LB2))
            below = gl.expand_dims(kk, 0) < gl.expand_dims(kr, 1)
            rank = gl.convert_layout(gl.sum(gl.where(below, gl.expand_dims(bit, 0), 0), 1), gl.SliceLayout(0, LB2))
        else:
            ident = end
            rank = bit
        if BOX > 0:
            n_tma = gl.maximum(ident - start, 0) // BLOCK_N
        else:
            n_tma = ident * 0
        n_tiles = (end - start + BLOCK_N - 1) // BLOCK_N
        return ident, n_tma, n_tiles, bt_ptr + s.to(gl.int64) * stride_bt, rank

    @gluon.jit
    def _issue_q(t, hb, H, q_smem, qpe_smem, q_bar, desc_q, desc_qpe, BLOCK_M: gl.constexpr):
        """An item's query tile (the token's 64 heads: rows t * H + hb * 64 .. of the [T * H, .] views) by TMA."""
        mbarrier.expect(q_bar, desc_q.block_type.nbytes + desc_qpe.block_type.nbytes)
        _tma_load(desc_q, [t * H + hb * BLOCK_M, 0], q_bar, q_smem)
        _tma_load(desc_qpe, [t * H + hb * BLOCK_M, 0], q_bar, qpe_smem)

    @gluon.jit
    def _mla_fwd_gluon_persistent_kernel(
        q_ptr, qpe_ptr, kv_ptr, bt_ptr, cu_ptr, pre_ptr, bits_ptr, out_ptr, po_ptr, pml_ptr, nc_ptr, desc_l, desc_r,
        desc_q, desc_qpe,
        S, H, HT, GC, qk_scale,
        stride_qt, stride_qh, stride_pt, stride_ph, stride_kv, stride_bt, stride_bits, stride_ot, stride_oh,
        TILES, NPROG,
        DL: gl.constexpr, DR: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        NCH: gl.constexpr, C_MIN: gl.constexpr, RULE: gl.constexpr, S_PAD: gl.constexpr, TREE: gl.constexpr,
        NB: gl.constexpr, STAGES: gl.constexpr, BOX: gl.constexpr,
    ):
        gl.static_assert(BLOCK_M == 64 and BLOCK_N == 64 and DL == 512 and DR == 64 and STAGES == 2)
        gl.static_assert(BOX == 0 or (BOX % 8 == 0 and (PAGE % BLOCK_N == 0 if BOX == BLOCK_N else BOX == PAGE)
                                      and BLOCK_N // BOX <= 4))
        gl.static_assert(gl.num_warps() == 8)
        # --- layouts (as _mla_gluon) ---
        L1: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])
        LB2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [8, 1], [1, 0])
        LKV: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        LPE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, 32, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, 256, 16])
        dt: gl.constexpr = kv_ptr.dtype.element_ty
        SH_KV: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], dt)
        SH_PE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], dt)
        SH_P: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dt)

        # --- the items: chunk indices past every row's chunk count are never visited ---
        so = gl.arange(0, S_PAD, layout=L1)
        k_len = gl.load(pre_ptr + so, mask=so < S, other=0) + gl.load(cu_ptr + so + 1, mask=so < S, other=0) \
            - gl.load(cu_ptr + so, mask=so < S, other=0)
        k_max = gl.max(k_len, 0)  # every row of the launch has at most k_max keys
        nc_max = gl.maximum(gl.minimum(gl.minimum((k_max + C_MIN - 1) // C_MIN, NCH), GC), 1)
        TOTAL = TILES * nc_max

        q_smem = gl.allocate_shared_memory(dt, [BLOCK_M, DL], SH_KV)
        qpe_smem = gl.allocate_shared_memory(dt, [BLOCK_M, DR], SH_PE)
        ckv_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DL], SH_KV)
        kpe_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DR], SH_PE)
        p_smem = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N], SH_P)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES + 1, 1], mbarrier.MBarrierLayout())
        q_bar = bars.index(STAGES)

        # --- the loader's item: the program's first ---
        lw, l_pt, l_pc, l_t, l_s, l_L, l_bit, l_nc, l_start, l_end = _find_item(
            gl.program_id(0), TILES, TOTAL, NPROG, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, RULE, BLOCK_N,
            NCH, C_MIN, S_PAD, TREE, NB, L1, LB2)
        if l_nc == 0:
            return
        for i in gl.static_range(STAGES + 1):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        l_ident, l_ntma, l_ntiles, l_bt, l_rank = _item_loads(l_s, l_L, l_bit, l_start, l_end, bt_ptr,
                                                              stride_bt, BLOCK_N, TREE, NB, BOX, LB2)
        if l_pc == 0:
            gl.store(nc_ptr + l_pt, l_nc)
        # the computer's item = this one; its query tile and first tile
        c_pt = l_pt
        c_pc = l_pc
        c_nc = l_nc
        c_start = l_start
        c_end = l_end
        c_ntiles = l_ntiles
        c_ntma = l_ntma
        _issue_q(l_t, l_pt % HT, H, q_smem, qpe_smem, q_bar, desc_q, desc_qpe, BLOCK_M)
        rows, valid = _tile_rows(l_start, l_start, l_end, l_ident, l_L, l_bit, l_rank, l_bt, PAGE, BLOCK_N, NB,
                                 TREE, L1, LB2)
        boxes = _tile_boxes(l_start, l_end, l_bt, PAGE, BOX)
        _load_tile(0, l_ntma, boxes, kv_ptr, stride_kv, rows, valid, ckv_smem.index(0), kpe_smem.index(0),
                   bars.index(0), desc_l, desc_r, DL, DR, BOX, LKV, LPE)
        cp.commit_group()
        # advance the loader to tile 1 and look it up
        l_j = 1
        if l_ntiles == 1:
            lw, l_pt, l_pc, l_t, l_s, l_L, l_bit, l_nc, l_start, l_end = _find_item(
                lw + NPROG, TILES, TOTAL, NPROG, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, RULE, BLOCK_N,
                NCH, C_MIN, S_PAD, TREE, NB, L1, LB2)
            l_ident, l_ntma, l_ntiles, l_bt, l_rank = _item_loads(l_s, l_L, l_bit, l_start, l_end, bt_ptr,
                                                                  stride_bt, BLOCK_N, TREE, NB, BOX, LB2)
            l_j = 0
        k0 = l_start + l_j * BLOCK_N
        rows, valid = _tile_rows(k0, l_start, l_end, l_ident, l_L, l_bit, l_rank, l_bt, PAGE, BLOCK_N, NB,
                                 TREE, L1, LB2)
        boxes = _tile_boxes(k0, l_end, l_bt, PAGE, BOX)

        # tile 0's S (the query and tile 0 landed), then tile 1's copies (its query, if a new item, only
        # now: the query tile is single-buffered)
        tph = 0  # bit s: the phase stage s's next TMA tile completes
        cp.wait_group(0)
        if c_ntma > 0:
            mbarrier.wait(bars.index(0), 0)
            tph = 1
        mbarrier.wait(q_bar, 0)
        qph = 1
        fence_async_shared()
        _cta_barrier()
        sc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L)
        sc = warpgroup_mma(q_smem, ckv_smem.index(0).permute((1, 0)), sc, use_acc=False, is_async=True)
        sc = warpgroup_mma(qpe_smem, kpe_smem.index(0).permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        _cta_barrier()  # every warp is done with the query tile before a new item's is loaded over it

        p_ok = False  # the pending record (an item whose first tile is loaded, its S not started)
        p_pt = c_pt
        p_pc = c_pc
        p_nc = c_nc
        p_start = c_start
        p_end = c_end
        p_ntiles = c_ntiles
        p_ntma = c_ntma
        if l_nc > 0:
            _load_tile(l_j, l_ntma, boxes, kv_ptr, stride_kv, rows, valid, ckv_smem.index(1), kpe_smem.index(1),
                       bars.index(1), desc_l, desc_r, DL, DR, BOX, LKV, LPE)
            if l_j == 0:
                if l_pc == 0:
                    gl.store(nc_ptr + l_pt, l_nc)
                _issue_q(l_t, l_pt % HT, H, q_smem, qpe_smem, q_bar, desc_q, desc_qpe, BLOCK_M)
                p_ok = True
                p_pt = l_pt
                p_pc = l_pc
                p_nc = l_nc
                p_start = l_start
                p_end = l_end
                p_ntiles = l_ntiles
                p_ntma = l_ntma
        cp.commit_group()
        if l_nc > 0:  # the loader to the next tile
            l_j += 1
            if l_j == l_ntiles:
                lw, l_pt, l_pc, l_t, l_s, l_L, l_bit, l_nc, l_start, l_end = _find_item(
                    lw + NPROG, TILES, TOTAL, NPROG, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, RULE,
                    BLOCK_N, NCH, C_MIN, S_PAD, TREE, NB, L1, LB2)
                l_ident, l_ntma, l_ntiles, l_bt, l_rank = _item_loads(l_s, l_L, l_bit, l_start, l_end, bt_ptr,
                                                                      stride_bt, BLOCK_N, TREE, NB, BOX, LB2)
                l_j = 0
            k0 = l_start + l_j * BLOCK_N
            rows, valid = _tile_rows(k0, l_start, l_end, l_ident, l_L, l_bit, l_rank, l_bt, PAGE, BLOCK_N, NB,
                                     TREE, L1, LB2)
            boxes = _tile_boxes(k0, l_end, l_bt, PAGE, BOX)

        m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        li = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, S_L))
        o = gl.zeros([BLOCK_M, DL], gl.float32, layout=O_L)
        cols_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
        c_j = 0
        stage = 0
        # tile g of the stream (stage g % 2): softmax of S_g, O += P_g V_g and S_{g+1} back to back on the
        # tensor cores; the end of an item stores its output or partial; then tile g + 2's copies go into the
        # freed stage (a new item's query tile with its first) and the loader looks up the tile after
        while c_ntiles > 0:
            m, li, pr, alpha = _softmax_tile(sc, m, li, c_start + c_j * BLOCK_N + cols_s, c_end, qk_scale)
            p_smem.store(pr.to(dt))
            fence_async_shared()
            _cta_barrier()
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
            o = warpgroup_mma(p_smem, ckv_smem.index(stage), o, is_async=True)
            last = c_j + 1 == c_ntiles
            if (not last) | p_ok:  # tile g + 1 exists: wait for it (and a new item's query tile), its S
                nxt = 1 - stage
                if last:
                    n_tma = p_ntma > 0
                else:
                    n_tma = c_j + 1 < c_ntma
                cp.wait_group(0)
                if n_tma:
                    mbarrier.wait(bars.index(nxt), (tph >> nxt) & 1)
                    tph = tph ^ (1 << nxt)
                if last:
                    mbarrier.wait(q_bar, qph & 1)
                    qph += 1
                fence_async_shared()
                _cta_barrier()
                sc = warpgroup_mma(q_smem, ckv_smem.index(nxt).permute((1, 0)), sc, use_acc=False,
                                   is_async=True)
                sc = warpgroup_mma(qpe_smem, kpe_smem.index(nxt).permute((1, 0)), sc, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            _cta_barrier()  # every warp is done with stage g, P and (at an item's end) the query tile
            if last:  # the item's output (one chunk) or partial; the pending item becomes the computer's
                _store_item(o, m, li, c_pt, c_pc, c_nc, HT, GC, out_ptr, po_ptr, pml_ptr, stride_ot, stride_oh,
                            H, BLOCK_M, DL, S_L, O_L)
                m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
                li = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, S_L))
                o = gl.zeros([BLOCK_M, DL], gl.float32, layout=O_L)
                c_pt = p_pt
                c_pc = p_pc
                c_nc = p_nc
                c_start = p_start
                c_end = p_end
                c_ntiles = gl.where(p_ok, p_ntiles, 0)
                c_ntma = p_ntma
                c_j = 0
                p_ok = False
            else:
                c_j += 1
            # tile g + 2 into the stage tile g leaves
            if l_nc > 0:
                _load_tile(l_j, l_ntma, boxes, kv_ptr, stride_kv, rows, valid, ckv_smem.index(stage),
                           kpe_smem.index(stage), bars.index(stage), desc_l, desc_r, DL, DR, BOX, LKV, LPE)
                if l_j == 0:  # a new item: its query tile (the last S of the item before is done) and record
                    if l_pc == 0:
                        gl.store(nc_ptr + l_pt, l_nc)
                    _issue_q(l_t, l_pt % HT, H, q_smem, qpe_smem, q_bar, desc_q, desc_qpe, BLOCK_M)
                    p_ok = True
                    p_pt = l_pt
                    p_pc = l_pc
                    p_nc = l_nc
                    p_start = l_start
                    p_end = l_end
                    p_ntiles = l_ntiles
                    p_ntma = l_ntma
            cp.commit_group()
            if l_nc > 0:
                l_j += 1
                if l_j == l_ntiles:
                    lw, l_pt, l_pc, l_t, l_s, l_L, l_bit, l_nc, l_start, l_end = _find_item(
                        lw + NPROG, TILES, TOTAL, NPROG, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, RULE,
                        BLOCK_N, NCH, C_MIN, S_PAD, TREE, NB, L1, LB2)
                    l_ident, l_ntma, l_ntiles, l_bt, l_rank = _item_loads(l_s, l_L, l_bit, l_start, l_end,
                                                                          bt_ptr, stride_bt, BLOCK_N, TREE, NB,
                                                                          BOX, LB2)
                    l_j = 0
                k0 = l_start + l_j * BLOCK_N
                rows, valid = _tile_rows(k0, l_start, l_end, l_ident, l_L, l_bit, l_rank, l_bt, PAGE, BLOCK_N,
                                         NB, TREE, L1, LB2)
                boxes = _tile_boxes(k0, l_end, l_bt, PAGE, BOX)
            stage = 1 - stage
        cp.wait_group(0)
        for i in gl.static_range(STAGES + 1):
            mbarrier.invalidate(bars.index(i))
