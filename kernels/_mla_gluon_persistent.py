"""Persistent form of the Gluon MLA kernel (`_mla_gluon`): one program per SM walks its share of the work items
and runs their tiles as one stream, so a chunk's fixed cost overlaps the tiles around it. Opt-in
(`GLUON_PERSISTENT`, `mla_attention_triton(..., persistent=True)`): the grid kernel's bits on the H200, 9-15% slower
(twenty-seventh session).

The work items are `_mla_gluon`'s: (query tile, KV chunk), item w = pid_c * tiles + pid_t (the order the
non-persistent grid runs them in), program k takes w = k, k + NPROG, ... and skips the empty ones (pid_c >= nc)
and, without looking, every item of a chunk index no row of the launch reaches. Every tile is computed by the
same code on the same bytes in the same order as in `_mla_gluon` (the same softmax, MMAs, masks and partials),
so **the bits are those of the non-persistent kernel**; only when things happen changes:

- the copies run one tile ahead and the lookups two, as in `_mla_gluon`, but across item boundaries: an item's
  last tiles overlap the next item's first copies, its query tile (by TMA, issued with its first tile, once the
  previous item's last S is done) and the lookups of its session, prefix and block table;
- the per-launch costs (a CTA's start, barrier setup, the first tiles' latency) are paid once per SM, not once per
  (token, chunk).

Iteration g of the stream (tile g in stage g % 2, S_g done): tile g + 1 is issued into the other stage and the
loader looks up the tile after; then the softmax of S_g, O += P_g V_g and S_{g+1} back to back on the tensor cores;
at an item's last tile its output or partial is stored and the pending item becomes the computer's.

Item state lives in registers: the loader's (the item whose tile is copied next, its ancestor ranks, the next
tile's pool rows), the computer's (the item whose tile is in S) and one pending record (an item whose first tile
is loaded and whose S has not started: the copies run one tile ahead and the pop of an item's end comes before the
next push, so one is enough). TMA completions on the two stage barriers are counted per stage (phase = count & 1),
the query tile's per item; one cp.async group is committed per tile issue. `tests/kernels/
test_mla_persistent_schedule.py` replays this control flow on the CPU; keep the two in step.

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
    from kernels._mla_gluon import (
        _L1,
        _LB2,
        _LKV,
        _LPE,
        _O_L,
        _S_L,
        _ancestor_ranks,
        _check_box,
        _issue_q,
        _item_query,
        _load_tile,
        _softmax_tile,
        _store_item,
        _tile_boxes,
        _tile_rows,
    )
    from kernels._mla_gluon_ws import _opaque_zero
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

from kernels._mla_kernels import chunk_span

GLUON_PERSISTENT = False  # opt-in: the grid kernel's bits, measured 9-15% slower (H200, twenty-seventh session)

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
        """What the loader needs of an item: (ident, n_tma, bt_row, rank) as `_mla_gluon`'s prologue."""
        if TREE:
            ident = gl.minimum(end, L)
        else:
            ident = end
        rank = _ancestor_ranks(bit, NB, TREE, LB2)
        if BOX > 0:
            n_tma = gl.maximum(ident - start, 0) // BLOCK_N
        else:
            n_tma = ident * 0
        return ident, n_tma, bt_ptr + s.to(gl.int64) * stride_bt, rank

    @gluon.jit
    def _issue(stage, lw, l_j, l_nc, l_ntma, l_start, l_end, rows, valid, boxes, pend, TILES, HT, H,
               kv_ptr, stride_kv, nc_ptr, ckv_smem, kpe_smem, q_smem, qpe_smem, bars, desc_l, desc_r, desc_q,
               desc_qpe, DL: gl.constexpr, DR: gl.constexpr, BOX: gl.constexpr, BLOCK_M: gl.constexpr,
               STAGES: gl.constexpr, LKV: gl.constexpr, LPE: gl.constexpr):
        """The loader's tile into `stage` (one cp.async group committed either way). The first tile of an item also
        loads its query tile (the caller has every S of the item before done) and makes it the pending record
        pend = (nc, w, start, end, n_tma) (nc = 0: none), which is returned."""
        if l_nc > 0:
            _load_tile(l_j, l_ntma, boxes, kv_ptr, stride_kv, rows, valid, ckv_smem.index(stage),
                       kpe_smem.index(stage), bars.index(stage), desc_l, desc_r, DL, DR, BOX, LKV, LPE)
            if l_j == 0:
                pid_t = lw % TILES
                if lw < TILES:  # chunk 0 of a query tile: its chunk count, for the combine
                    gl.store(nc_ptr + pid_t, l_nc)
                _issue_q(pid_t // HT, pid_t % HT, H, q_smem, qpe_smem, bars.index(STAGES), desc_q, desc_qpe,
                         BLOCK_M)
                pend = (l_nc, lw, l_start, l_end, l_ntma)
        cp.commit_group()
        return pend

    @gluon.jit
    def _next_item(w, TILES, TOTAL, NPROG, cu_ptr, pre_ptr, bits_ptr, bt_ptr, S, HT, stride_bits, stride_bt,
                   RULE: gl.constexpr, BLOCK_N: gl.constexpr, NCH: gl.constexpr, C_MIN: gl.constexpr,
                   S_PAD: gl.constexpr, TREE: gl.constexpr, NB: gl.constexpr, BOX: gl.constexpr, L1: gl.constexpr,
                   LB2: gl.constexpr):
        """The loader's state at the first tile of the first non-empty item from w on (nc = 0: none left):
        (w, L, bit, nc, start, end, ident, n_tma, bt_row, rank)."""
        w, pid_t, pid_c, t, s, L, bit, nc, start, end = _find_item(
            w, TILES, TOTAL, NPROG, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, RULE, BLOCK_N, NCH, C_MIN, S_PAD,
            TREE, NB, L1, LB2)
        ident, n_tma, bt_row, rank = _item_loads(s, L, bit, start, end, bt_ptr, stride_bt, BLOCK_N, TREE, NB, BOX,
                                                 LB2)
        return w, L, bit, nc, start, end, ident, n_tma, bt_row, rank

    @gluon.jit
    def _tile_lookup(l_j, l_L, l_bit, l_start, l_end, l_ident, l_bt, l_rank, PAGE: gl.constexpr,
                     BLOCK_N: gl.constexpr, NB: gl.constexpr, TREE: gl.constexpr, BOX: gl.constexpr,
                     L1: gl.constexpr, LB2: gl.constexpr):
        """The loader's next tile: its pool rows and which count (cp.async) and its boxes' first rows (TMA)."""
        k0 = l_start + l_j * BLOCK_N
        rows, valid = _tile_rows(k0, l_start, l_end, l_ident, l_L, l_bit, l_rank, l_bt, PAGE, BLOCK_N, NB, TREE, L1,
                                 LB2)
        return rows, valid, _tile_boxes(k0, l_end, l_bt, PAGE, BOX)

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
        _check_box(BOX, PAGE, BLOCK_N)
        gl.static_assert(gl.num_warps() == 8)
        dt: gl.constexpr = kv_ptr.dtype.element_ty
        SH_KV: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], dt)
        SH_PE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], dt)
        SH_P: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dt)

        # --- the items: chunk indices past every row's chunk count are never visited ---
        so = gl.arange(0, S_PAD, layout=_L1)
        k_len = gl.load(pre_ptr + so, mask=so < S, other=0) + gl.load(cu_ptr + so + 1, mask=so < S, other=0) \
            - gl.load(cu_ptr + so, mask=so < S, other=0)
        k_max = gl.max(k_len, 0)  # every row of the launch has at most k_max keys
        nc_max = gl.maximum(gl.minimum(gl.minimum((k_max + C_MIN - 1) // C_MIN, NCH), GC), 1)
        TOTAL = TILES * nc_max

        # --- the loader: the program's first item ---
        lw, l_L, l_bit, l_nc, l_start, l_end, l_ident, l_ntma, l_bt, l_rank = _next_item(
            gl.program_id(0), TILES, TOTAL, NPROG, cu_ptr, pre_ptr, bits_ptr, bt_ptr, S, HT, stride_bits, stride_bt,
            RULE, BLOCK_N, NCH, C_MIN, S_PAD, TREE, NB, BOX, _L1, _LB2)
        if l_nc == 0:
            return

        # [1, ..]: the stream's S reads them through an opaque index (see _mla_gluon_ws._opaque_zero)
        q_all = gl.allocate_shared_memory(dt, [1, BLOCK_M, DL], SH_KV)
        qpe_all = gl.allocate_shared_memory(dt, [1, BLOCK_M, DR], SH_PE)
        q_smem = q_all.index(0)
        qpe_smem = qpe_all.index(0)
        ckv_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DL], SH_KV)
        kpe_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DR], SH_PE)
        p_smem = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N], SH_P)
        # TMA arrivals: bars[s] the tiles of stage s, bars[STAGES] the query tile
        bars = gl.allocate_shared_memory(gl.int64, [STAGES + 1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES + 1):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()

        # --- tile 0 (and the first query tile), which the computer takes at once ---
        l_j = 0
        rows, valid, boxes = _tile_lookup(l_j, l_L, l_bit, l_start, l_end, l_ident, l_bt, l_rank, PAGE, BLOCK_N, NB,
                                          TREE, BOX, _L1, _LB2)
        none = (l_nc * 0, lw, l_start, l_end, l_ntma)  # no record (nc = 0)
        c_nc, c_w, c_start, c_end, c_ntma = _issue(
            0, lw, l_j, l_nc, l_ntma, l_start, l_end, rows, valid, boxes, none, TILES, HT, H, kv_ptr, stride_kv,
            nc_ptr, ckv_smem, kpe_smem, q_smem, qpe_smem, bars, desc_l, desc_r, desc_q, desc_qpe, DL, DR, BOX, BLOCK_M,
            STAGES, _LKV, _LPE)
        p_nc, p_w, p_start, p_end, p_ntma = none  # the pending record: none yet
        l_j = 1
        if l_start + l_j * BLOCK_N >= l_end:  # the item had one tile
            lw, l_L, l_bit, l_nc, l_start, l_end, l_ident, l_ntma, l_bt, l_rank = _next_item(
                lw + NPROG, TILES, TOTAL, NPROG, cu_ptr, pre_ptr, bits_ptr, bt_ptr, S, HT, stride_bits, stride_bt,
                RULE, BLOCK_N, NCH, C_MIN, S_PAD, TREE, NB, BOX, _L1, _LB2)
            l_j = 0
        rows, valid, boxes = _tile_lookup(l_j, l_L, l_bit, l_start, l_end, l_ident, l_bt, l_rank, PAGE, BLOCK_N, NB,
                                          TREE, BOX, _L1, _LB2)

        tph = 0  # bit s: the phase stage s's next TMA tile completes
        cp.wait_group(0)
        if c_ntma > 0:
            mbarrier.wait(bars.index(0), 0)
            tph = 1
        mbarrier.wait(bars.index(STAGES), 0)
        qph = 1
        fence_async_shared()
        _cta_barrier()
        sc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=_S_L)
        sc = warpgroup_mma(q_smem, ckv_smem.index(0).permute((1, 0)), sc, use_acc=False, is_async=True)
        sc = warpgroup_mma(qpe_smem, kpe_smem.index(0).permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        _cta_barrier()  # every warp is done with the query tile (tile 1 may bring a new item's)

        m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, _S_L))
        li = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, _S_L))
        o = gl.zeros([BLOCK_M, DL], gl.float32, layout=_O_L)
        cols_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, _S_L))
        c_j = 0
        stage = 0
        # tile g of the stream (stage g % 2; S_g done): tile g + 1's copies go into the other stage (a new item's
        # query tile with its first: S_g, the last to read the query tile, is done) and the loader looks up the
        # tile after; then the softmax of S_g, O += P_g V_g and S_{g+1} back to back on the tensor cores; an item's
        # last tile stores its output or partial and the pending item becomes the computer's
        while c_nc > 0:
            p_nc, p_w, p_start, p_end, p_ntma = _issue(
                1 - stage, lw, l_j, l_nc, l_ntma, l_start, l_end, rows, valid, boxes,
                (p_nc, p_w, p_start, p_end, p_ntma), TILES, HT, H, kv_ptr, stride_kv, nc_ptr, ckv_smem, kpe_smem,
                q_smem, qpe_smem, bars, desc_l, desc_r, desc_q, desc_qpe, DL, DR, BOX, BLOCK_M, STAGES, _LKV, _LPE)
            if l_nc > 0:
                l_j += 1
                if l_start + l_j * BLOCK_N >= l_end:  # past the item's last tile
                    lw, l_L, l_bit, l_nc, l_start, l_end, l_ident, l_ntma, l_bt, l_rank = _next_item(
                        lw + NPROG, TILES, TOTAL, NPROG, cu_ptr, pre_ptr, bits_ptr, bt_ptr, S, HT, stride_bits,
                        stride_bt, RULE, BLOCK_N, NCH, C_MIN, S_PAD, TREE, NB, BOX, _L1, _LB2)
                    l_j = 0
                rows, valid, boxes = _tile_lookup(l_j, l_L, l_bit, l_start, l_end, l_ident, l_bt, l_rank, PAGE,
                                                  BLOCK_N, NB, TREE, BOX, _L1, _LB2)

            m, li, pr, alpha = _softmax_tile(sc, m, li, c_start + c_j * BLOCK_N + cols_s, c_end, qk_scale)
            p_smem.store(pr.to(dt))
            fence_async_shared()
            _cta_barrier()
            o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, _O_L)), 1)
            o = warpgroup_mma(p_smem, ckv_smem.index(stage), o, is_async=True)
            last = c_start + (c_j + 1) * BLOCK_N >= c_end
            if (not last) | (p_nc > 0):  # tile g + 1 exists: wait for it (and a new item's query tile), its S
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
                    mbarrier.wait(bars.index(STAGES), qph & 1)
                    qph += 1
                fence_async_shared()
                _cta_barrier()
                z = _opaque_zero(c_j)  # Q's 36 wgmma descriptors stay in the loop instead of spilled registers
                sc = warpgroup_mma(q_all.index(z), ckv_smem.index(nxt).permute((1, 0)), sc, use_acc=False,
                                   is_async=True)
                sc = warpgroup_mma(qpe_all.index(z), kpe_smem.index(nxt).permute((1, 0)), sc, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            _cta_barrier()  # every warp is done with stage g, P and the query tile before they are loaded again
            if last:  # the item's output (one chunk) or partial; the pending item becomes the computer's
                _store_item(o, m, li, c_w % TILES, c_w // TILES, c_nc, HT, GC, out_ptr, po_ptr, pml_ptr, stride_ot,
                            stride_oh, H, BLOCK_M, DL, _S_L, _O_L)
                m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, _S_L))
                li = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, _S_L))
                o = gl.zeros([BLOCK_M, DL], gl.float32, layout=_O_L)
                c_w = p_w
                c_nc = p_nc  # 0: no pending item, the stream ends
                c_start = p_start
                c_end = p_end
                c_ntma = p_ntma
                c_j = 0
                p_nc = p_nc * 0
            else:
                c_j += 1
            stage = 1 - stage
        cp.wait_group(0)
        for i in gl.static_range(STAGES + 1):
            mbarrier.invalidate(bars.index(i))
