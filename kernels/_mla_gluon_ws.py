"""Warp-specialized Gluon (Hopper) kernel of `kernels.mla_attention` (experimental, opt-in: impl="gluon_ws").

Same work unit, keys, chunks, partials and combine as `_mla_gluon._mla_fwd_gluon_kernel` (a query tile is
the 64 heads of one token, a chunk a `chunk_span` of whole 64-key tiles at absolute positions; nc == 1
writes the output, else the partials that `_mla_combine_kernel` folds in chunk order). What differs is
who does what inside a program. The sixth-session kernel runs every tile through all 8 warps: wait for
the copies -> S -> softmax -> P to shared -> PV, each step behind a CTA-wide barrier, so the tensor pipe
idles while the softmax runs (ncu: busy 29%). Here the roles are split, after FlashMLA's decode kernel:

  consumer 0, consumer 1   one warpgroup each (the default partition and a 4-warp worker). Tile j is
                           OWNED by consumer j % 2: the owner computes the whole S_j [64 rows, 64 keys]
                           = Q K_j^T (wgmma m64n64, K = 576) and its online softmax (row max / sum stay
                           inside one warpgroup), writes P_j (bf16) and (m, l, alpha) to shared memory,
                           then BOTH consumers add P_j V_j into their own 256 of the 512 value columns
                           (wgmma m64n256; the owner takes P_j from registers, the other from shared).
  producer                 one warp with few registers: looks the tile's pool rows up (block table,
                           tree ancestors) and gathers them with 16-byte cp.async into a 2-stage ring;
                           the copies arrive on the stage's `full` barrier when they land.

The running max must stay sequential across tiles: the owner of tile j starts from (m, l) after tile
j - 1, which the other consumer published with P_{j-1}. Per own tile j a consumer does, in order:

  wait P_{j-1} published; O *= alpha_{j-1}; O += P_{j-1} V_{j-1} (P from shared); release stage (j-1) % 2
  wait tile j landed; S_j = Q K_j^T; softmax of S_j -> P_j, m, l, alpha_j; publish P_j, m, l, alpha_j
  O *= alpha_j; O += P_j V_j (P from registers); release stage j % 2

The two PV of a tile run together on the tensor cores, then the next tile's owner runs S and the
softmax; the tensor pipe idles during the softmax and the hand-offs only (no CTA-wide barrier, no copy
wait: the copies run up to two tiles ahead). PV_{j-1} goes before S_j because wgmma waits are in issue
order: with S_j first, the stage of tile j - 1 could only be released once S_j is done, so the load of
tile j + 1 (same stage) would wait on the arrival of tile j, and with two stages every tile would pay the
copy latency (a rough timing model of both orders keeps the tensor pipe ~87% busy with this one, 60-76%
with S first once a tile's load takes more than ~0.6 us; to be measured). Each
wgmma is waited for before control flow merges: an accumulator in flight across a branch or a loop
edge gets copied, and ptxas then serialises every wgmma of the kernel (warning C7514).

Synchronisation is mbarriers only (no CTA-wide barrier after the prologue):
  q_bar          count 32  the producer's lanes arrive (cp.async.mbarrier.arrive.noinc) when Q landed
  full[s]        count 32  same for the tile in stage s; tile j completes phase j // 2 of full[j % 2]
  empty[s]       count 2   each consumer arrives once it is done with the tile in stage s (S and PV);
                           the producer waits phase (j // 2 - 1) & 1 before refilling it with tile j
  p_bar          count 1   the owner of tile j arrives after publishing P_j and (m, l, alpha): phase j
One P buffer and one (m, l, alpha) slot suffice (there is no shared memory for two) because every write
to them is made by the consumer that read the previous contents: P_{j+1} is written by the owner of
j + 1, which is the consumer that read P_j (its PV_j has completed, wgmma wait, before it writes); the
owner of j reads nothing of P_j from shared. No waiter can miss a phase either: p_bar's next phase
needs the waiter's own tile, and a stage is refilled only after both consumers released it. Both
consumers wait full[s] themselves before reading a stage (cp.async writes through the generic proxy,
wgmma reads through the async proxy: fence after the wait).

Determinism: the owner of a tile is the parity of its index in the chunk, and chunks start at absolute
positions that depend only on the row's position, so a row's tiles always go through the same
consumers with the same instructions; both consumers run identical S and softmax code. Every tile, hot
or ragged, runs the same masked arithmetic, as in the other kernels: results are batch-invariant and
position-aligned within this impl (not bitwise equal to "gluon" or "triton").

Fixed shapes: 64 heads per tile, latent 512 + rope 64, 64-key tiles, bf16 or fp16, sm_90. Launch with
num_warps=4 (consumer 0); workers add 4 + 1 warps (the compiler pads to 12 warps: 3 warpgroups), and
setmaxnreg gives consumer 1 CONSUMER_REGS registers, the producer's warpgroup PRODUCER_REGS and
consumer 0 the rest. Shared memory: Q 72 KB + 2 x 72 KB KV stages + P 8 KB + tree rows, pool rows,
(m, l, alpha), barriers: 226 KB of the 227 KB an sm_90 block may have (one CTA per SM).
"""

from __future__ import annotations

from kernels._mla_gluon import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from kernels._mla_gluon import _ST_HALF_L, _ancestor_ranks, _cp_async, _item_query, _softmax_tile, _store_partial

from kernels._mla_kernels import chunk_span

WS_WARPS = 4  # the launch's num_warps: consumer 0 (the default partition); consumer 1 and the producer are workers
WS_STAGES = 2  # KV ring depth (3 stages of 72 KB do not fit beside Q)
CONSUMER_REGS = 224  # setmaxnreg of consumer 1 (consumer 0 gets the rest: 232); spill-free from 224 (ptxas)
PRODUCER_REGS = 48  # the producer warp's warpgroup (12 warps x 32 lanes share 64K registers: 504 per lane in all)

if HAVE_GLUON:
    _ROWS_KV = gl.constexpr(8)  # rows per cp.async batch of the latent part (bounds the producer's live pointers)
    _ROWS_PE = gl.constexpr(32)  # rows per batch of the rope part
    _REGS = gl.constexpr([CONSUMER_REGS, PRODUCER_REGS])

    # ----------------------------------------------------------------------------------------- producer

    @gluon.jit
    def _copy_rows(dst_l, dst_r, base_l, base_r, stride_l, stride_r, rows_smem, n_valid,
                   DL: gl.constexpr, DR: gl.constexpr, NROWS: gl.constexpr):
        """cp.async NROWS rows (global element offsets rows_smem[r] * stride from base_l / base_r) into
        dst_l [NROWS, DL] and dst_r [NROWS, DR]; rows r >= n_valid are zero-filled. One warp, in batches of
        rows so that only a few row pointers are live at a time."""
        LKV: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [1, 1], [1, 0])  # 16-byte copies along DL
        LPE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
        c1 = gl.arange(0, DL, layout=gl.SliceLayout(0, LKV))
        for r0 in gl.static_range(0, NROWS, _ROWS_KV):
            r = r0 + gl.arange(0, _ROWS_KV, layout=gl.SliceLayout(1, LKV))
            row = rows_smem.slice(r0, _ROWS_KV).load(gl.SliceLayout(1, LKV)).to(gl.int64)
            ptr = base_l + gl.expand_dims(row * stride_l, 1) + gl.expand_dims(c1, 0)
            _cp_async(dst_l.slice(r0, _ROWS_KV), ptr, mask=gl.expand_dims(r < n_valid, 1) & gl.expand_dims(c1 < DL, 0))
        c2 = gl.arange(0, DR, layout=gl.SliceLayout(0, LPE))
        for r0 in gl.static_range(0, NROWS, _ROWS_PE):
            r = r0 + gl.arange(0, _ROWS_PE, layout=gl.SliceLayout(1, LPE))
            row = rows_smem.slice(r0, _ROWS_PE).load(gl.SliceLayout(1, LPE)).to(gl.int64)
            ptr = base_r + gl.expand_dims(row * stride_r, 1) + gl.expand_dims(c2, 0)
            _cp_async(dst_r.slice(r0, _ROWS_PE), ptr, mask=gl.expand_dims(r < n_valid, 1) & gl.expand_dims(c2 < DR, 0))

    @gluon.jit
    def _copy_query(q_ptr, qpe_ptr, q_dst, qpe_dst, rows_smem, q_bar, t64, hb, H, stride_qt, stride_qh, stride_pt,
                    stride_ph, DL: gl.constexpr, DR: gl.constexpr, BLOCK_M: gl.constexpr, LR: gl.constexpr):
        """The producer warp's copy of the query tile (heads hb * BLOCK_M.. of token t: rows of q_lat / q_pe) with
        cp.async, arriving on q_bar (its 32 lanes) when it landed."""
        rows_smem.store(gl.arange(0, BLOCK_M, layout=LR))
        _copy_rows(q_dst, qpe_dst, q_ptr + t64 * stride_qt + hb * BLOCK_M * stride_qh,
                   qpe_ptr + t64 * stride_pt + hb * BLOCK_M * stride_ph, stride_qh, stride_ph, rows_smem,
                   H - hb * BLOCK_M, DL, DR, BLOCK_M)
        cp.mbarrier_arrive(q_bar, increment_count=False)

    @gluon.jit
    def _pool_rows(k0, end, ident, L, bt_row, rows_smem, tree_smem, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                   TREE: gl.constexpr, LR: gl.constexpr, PHANTOM: gl.constexpr = False):
        """The pool rows of the tile at positions k0.. into rows_smem (int32: pools hold < 2^31 rows): through the
        block table, tree positions by the prologue's table; rows at or past `end` are 0 (and not copied).
        PHANTOM: the tile may lie wholly past `end` (a seesaw pair's padding), which must not read the table."""
        pos = k0 + gl.arange(0, BLOCK_N, layout=LR)
        valid = pos < end
        idx = pos
        if TREE:
            reaches = k0 + BLOCK_N > ident  # the tile reaches into the tree part: rows the prologue resolved
            if PHANTOM:
                reaches = reaches & (k0 < end)
            if reaches:
                idx = tree_smem.index(k0 // BLOCK_N - L // BLOCK_N).load(LR)
        page = gl.load(bt_row + idx // PAGE, mask=valid, other=0)
        rows_smem.store(page * PAGE + idx % PAGE)

    @gluon.jit
    def _producer(q_ptr, qpe_ptr, kv_ptr, bt_row, q_smem, qpe_smem, ckv_smem, kpe_smem, rows_smem, tree_smem,
                  q_bar, full, empty, t64, hb, H, L, start, end, ident, stride_qt, stride_qh, stride_pt, stride_ph,
                  stride_kv, DL: gl.constexpr, DR: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, TREE: gl.constexpr, STAGES: gl.constexpr):
        LR: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])  # [BLOCK_N] row lookups, one warp
        # Q first, its own barrier
        _copy_query(q_ptr, qpe_ptr, q_smem.index(0), qpe_smem.index(0), rows_smem, q_bar, t64, hb, H, stride_qt,
                    stride_qh, stride_pt, stride_ph, DL, DR, BLOCK_M, LR)
        n_tiles = (end - start + BLOCK_N - 1) // BLOCK_N
        for j in range(n_tiles):
            k0 = start + j * BLOCK_N
            _pool_rows(k0, end, ident, L, bt_row, rows_smem, tree_smem, PAGE, BLOCK_N, TREE, LR)
            st = j % STAGES
            # the block-table loads above overlap this wait: stage st is free once both consumers released tile
            # j - STAGES (phase j // STAGES - 1 of its `empty` barrier)
            mbarrier.wait(empty.index(st), (j // STAGES + 1) & 1, pred=j >= STAGES)
            _copy_rows(ckv_smem.index(st), kpe_smem.index(st), kv_ptr, kv_ptr + DL, stride_kv, stride_kv, rows_smem,
                       end - k0, DL, DR, BLOCK_N)
            cp.mbarrier_arrive(full.index(st), increment_count=False)  # each lane: when its copies have landed

    # ----------------------------------------------------------------------------------------- consumers

    @gluon.jit
    def _opaque_zero(j):
        """0, computed where the compilers cannot see it. Q's wgmma descriptors (36 x 64 bits) would otherwise
        be hoisted out of the tile loop as invariants and spilled; indexing Q by this keeps them in the loop."""
        return gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [j], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _take_other(j, o, p_smem, stats, ckv_smem, full, empty, p_bar, S_L: gl.constexpr, O_L: gl.constexpr,
                    HALF: gl.constexpr, V_OFF: gl.constexpr, STAGES: gl.constexpr):
        """Tile j belongs to the other consumer: wait until it published P_j and (m, l, alpha), rescale O,
        O += P_j V_j[:, our half] (P from shared), release the stage. Returns O and (m, l) after tile j."""
        mbarrier.wait(p_bar, j & 1)
        st = j % STAGES
        mbarrier.wait(full.index(st), (j // STAGES) & 1)  # complete already (the owner waited): orders V for us
        fence_async_shared()
        m_smem, l_smem, a_smem = stats
        m = m_smem.load(gl.SliceLayout(1, S_L))
        li = l_smem.load(gl.SliceLayout(1, S_L))
        alpha = a_smem.load(gl.SliceLayout(1, O_L))
        o = o * gl.expand_dims(alpha, 1)
        o = warpgroup_mma(p_smem, ckv_smem.index(st).slice(V_OFF, HALF, dim=1), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=(o,))  # from here on we neither read P_j nor the slot: ours to rewrite
        mbarrier.arrive(empty.index(st), count=1)  # lowered as: warpgroup barrier, then one lane arrives
        return o, m, li

    @gluon.jit
    def _own_tile(j, o, m, li, q_smem, qpe_smem, ckv_smem, kpe_smem, p_smem, stats, full, empty, p_bar,
                  start, end, qk_scale, S_L: gl.constexpr, O_L: gl.constexpr, HALF: gl.constexpr,
                  V_OFF: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """Our tile j: S_j = Q K_j^T, online softmax, publish P_j and (m, l, alpha) for the other consumer,
        rescale O, O += P_j V_j[:, our half] (P from registers), release the stage. The caller has read the
        P buffer and the slot for the last time (its PV_{j-1} completed)."""
        st = j % STAGES
        mbarrier.wait(full.index(st), (j // STAGES) & 1)
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async proxy
        sc = gl.zeros([o.shape[0], BLOCK_N], gl.float32, layout=S_L)
        z = _opaque_zero(j)
        sc = warpgroup_mma(q_smem.index(z), ckv_smem.index(st).permute((1, 0)), sc, use_acc=False, is_async=True)
        sc = warpgroup_mma(qpe_smem.index(z), kpe_smem.index(st).permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma_wait(0, deps=(sc,))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
        m, li, pr, alpha = _softmax_tile(sc, m, li, start + j * BLOCK_N + cols, end, qk_scale)
        pr = pr.to(p_smem.dtype)
        p_smem.store(pr)
        m_smem, l_smem, a_smem = stats
        m_smem.store(m)
        l_smem.store(li)
        a_smem.store(alpha)
        fence_async_shared()  # P is read by the other consumer's wgmma (async proxy)
        mbarrier.arrive(p_bar, count=1)  # after a warpgroup barrier: every warp's stores are in
        pa = gl.convert_layout(pr, gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2))
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_L)), 1)
        o = warpgroup_mma(pa, ckv_smem.index(st).slice(V_OFF, HALF, dim=1), o, is_async=True)
        o = warpgroup_mma_wait(0, deps=(o, pa))[0]
        mbarrier.arrive(empty.index(st), count=1)
        return o, m, li

    @gluon.jit
    def _consumer(q_smem, qpe_smem, ckv_smem, kpe_smem, p_smem, stats, q_bar, full, empty, p_bar,
                  out_ptr, po_ptr, pml_ptr, pid_t, pid_c, GC, t64, hb, H, nc, start, end, qk_scale,
                  stride_ot, stride_oh, W: gl.constexpr, DL: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """Consumer W (0: default partition, 1: worker): owns the tiles j with j % 2 == W, and value
        columns W * DL / 2 .. (W + 1) * DL / 2 - 1 of every tile."""
        HALF: gl.constexpr = DL // 2
        V_OFF: gl.constexpr = W * HALF
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HALF, 16])
        n_tiles = (end - start + BLOCK_N - 1) // BLOCK_N
        m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        li = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, S_L))
        o = gl.zeros([BLOCK_M, HALF], gl.float32, layout=O_L)
        mbarrier.wait(q_bar, 0)
        if W == 0:  # tile 0 is ours and has no predecessor
            o, m, li = _own_tile(0, o, m, li, q_smem, qpe_smem, ckv_smem, kpe_smem, p_smem, stats, full, empty,
                                 p_bar, start, end, qk_scale, S_L, O_L, HALF, V_OFF, BLOCK_N, STAGES)
        # the other consumer's tile j - 1 first: its stage is released before we wait for tile j (docstring)
        for j in range(2 - W, n_tiles, 2):
            o, m, li = _take_other(j - 1, o, p_smem, stats, ckv_smem, full, empty, p_bar, S_L, O_L, HALF, V_OFF,
                                   STAGES)
            o, m, li = _own_tile(j, o, m, li, q_smem, qpe_smem, ckv_smem, kpe_smem, p_smem, stats, full, empty,
                                 p_bar, start, end, qk_scale, S_L, O_L, HALF, V_OFF, BLOCK_N, STAGES)
        if (n_tiles - 1) % 2 != W:  # the last tile is the other consumer's
            o, m, li = _take_other(n_tiles - 1, o, p_smem, stats, ckv_smem, full, empty, p_bar, S_L, O_L, HALF,
                                   V_OFF, STAGES)

        rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_L))
        dl = gl.arange(0, HALF, layout=gl.SliceLayout(0, O_L))
        if nc == 1:
            lo = gl.convert_layout(li, gl.SliceLayout(1, O_L))
            out = o / gl.expand_dims(gl.where(lo == 0.0, 1.0, lo), 1)  # l == 0 only for a row that sees nothing
            h = hb * BLOCK_M + rm
            gl.store(out_ptr + t64 * stride_ot + gl.expand_dims(h * stride_oh, 1) + V_OFF + gl.expand_dims(dl, 0),
                     out.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(h < H, 1) & gl.expand_dims(dl < HALF, 0))
        else:
            part = (pid_t * GC + pid_c).to(gl.int64)
            _store_partial(po_ptr, part, o, BLOCK_M, DL, HALF, V_OFF, O_L, _ST_HALF_L)
            if W == 0:
                rs = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L))
                gl.store(pml_ptr + part * (2 * BLOCK_M) + rs, m)
                gl.store(pml_ptr + part * (2 * BLOCK_M) + BLOCK_M + rs, li)

    # ----------------------------------------------------------------------------------------- prologue

    @gluon.jit
    def _ws_chunk(cu_ptr, pre_ptr, bits_ptr, nc_ptr, S, HT, stride_bits, RULE: gl.constexpr, BLOCK_N: gl.constexpr,
                  NCH: gl.constexpr, C_MIN: gl.constexpr, S_PAD: gl.constexpr, TREE: gl.constexpr, NB: gl.constexpr,
                  L1: gl.constexpr, LB2: gl.constexpr):
        """This program's query row and chunk (as _mla_gluon), with the chunk count stored for the combine by chunk
        0: (pid_t, pid_c, hb, t, s, L, bit, nc, start, end, ident); the caller returns when pid_c >= nc."""
        pid_t = gl.program_id(0)
        pid_c = gl.program_id(1)
        hb = pid_t % HT
        t, s, L, bit, p = _item_query(pid_t, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, S_PAD, TREE, NB, L1, LB2)
        nc, start, end = chunk_span(p + 1, pid_c, RULE, BLOCK_N, NCH, C_MIN)
        if pid_c == 0:
            gl.store(nc_ptr + pid_t, nc)
        if TREE:
            ident = gl.minimum(end, L)
        else:
            ident = end
        return pid_t, pid_c, hb, t, s, L, bit, nc, start, end, ident

    @gluon.jit
    def _tree_table(tree_smem, L, end, bit, NB: gl.constexpr, BLOCK_N: gl.constexpr, TREE: gl.constexpr,
                    TT: gl.constexpr, LB2: gl.constexpr):
        """The producer's tree table: the logical row of each position of the TT tiles from L // BLOCK_N on
        (ancestors by depth), when this chunk reaches the tree part. The ancestors' ranks are computed here, under
        that branch: the chunks of the committed rows alone (all but a row's last) never pay for them."""
        if TREE:
            if end > L:
                rank = _ancestor_ranks(bit, NB, TREE, LB2)
                kk = gl.arange(0, NB, layout=gl.SliceLayout(0, LB2))
                for u in gl.static_range(TT):
                    pos = (L // BLOCK_N + u) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LB2))
                    e = pos - L  # depth of the ancestor at this position (< 0: committed row)
                    hit = (gl.expand_dims(bit, 0) != 0) & (gl.expand_dims(rank, 0) == gl.expand_dims(e, 1))
                    anc = gl.sum(gl.where(hit, gl.expand_dims(kk, 0), 0), 1)
                    tree_smem.index(u).store(gl.where(e >= 0, L + anc, pos))

    # ----------------------------------------------------------------------------------------- kernel

    @gluon.jit
    def _mla_fwd_gluon_ws_kernel(
        q_ptr, qpe_ptr, kv_ptr, bt_ptr, cu_ptr, pre_ptr, bits_ptr, out_ptr, po_ptr, pml_ptr, nc_ptr,
        S, H, HT, GC, qk_scale,
        stride_qt, stride_qh, stride_pt, stride_ph, stride_kv, stride_bt, stride_bits, stride_ot, stride_oh,
        DL: gl.constexpr, DR: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        NCH: gl.constexpr, C_MIN: gl.constexpr, RULE: gl.constexpr, S_PAD: gl.constexpr, TREE: gl.constexpr,
        NB: gl.constexpr, STAGES: gl.constexpr,
    ):
        """Arguments as `_mla_gluon._mla_fwd_gluon_kernel`. The prologue (consumer 0's warps) finds the
        query row and chunk, resolves the tree tiles' rows and sets up shared memory; then the partitions."""
        gl.static_assert(BLOCK_M == 64 and BLOCK_N == 64 and DL == 512 and DR == 64)
        gl.static_assert(gl.num_warps() == 4)
        L1: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        LB2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])  # [BLOCK_N, NB] tree lookups
        dt: gl.constexpr = kv_ptr.dtype.element_ty
        SH_KV: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], dt)
        SH_PE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], dt)
        SH_P: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dt)
        SH_1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # [n] vectors and stacks of them
        TT: gl.constexpr = NB // BLOCK_N + 1  # tiles that can hold tree positions L .. L + NB - 1

        # --- which query row and chunk (as _mla_gluon) ---
        pid_t, pid_c, hb, t, s, L, bit, nc, start, end, ident = _ws_chunk(
            cu_ptr, pre_ptr, bits_ptr, nc_ptr, S, HT, stride_bits, RULE, BLOCK_N, NCH, C_MIN, S_PAD, TREE, NB, L1, LB2)
        if pid_c >= nc:
            return

        # --- shared memory ---
        q_smem = gl.allocate_shared_memory(dt, [1, BLOCK_M, DL], SH_KV)  # [1, ..]: see _opaque_zero
        qpe_smem = gl.allocate_shared_memory(dt, [1, BLOCK_M, DR], SH_PE)
        ckv_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DL], SH_KV)
        kpe_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DR], SH_PE)
        p_smem = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N], SH_P)
        # m, l, alpha of the last published tile (3 buffers: no barrier between their stores)
        m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], SH_1)
        l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], SH_1)
        a_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], SH_1)
        stats = (m_smem, l_smem, a_smem)
        rows_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_N], SH_1)  # the producer's current pool rows
        tree_smem = gl.allocate_shared_memory(gl.int32, [TT, BLOCK_N], SH_1)  # logical rows of the tree tiles
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        p_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=32)  # the producer warp's lanes (cp.async.mbarrier.arrive.noinc)
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=32)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(p_bar, count=1)
        _tree_table(tree_smem, L, end, bit, NB, BLOCK_N, TREE, TT, LB2)
        # (the partitions start behind a CTA barrier, which orders these barrier inits and table stores)

        t64 = t.to(gl.int64)
        bt_row = bt_ptr + s.to(gl.int64) * stride_bt
        gl.warp_specialize([
            (_consumer, (q_smem, qpe_smem, ckv_smem, kpe_smem, p_smem, stats, q_bar, full, empty, p_bar,
                         out_ptr, po_ptr, pml_ptr, pid_t, pid_c, GC, t64, hb, H, nc, start, end, qk_scale,
                         stride_ot, stride_oh, 0, DL, BLOCK_M, BLOCK_N, STAGES)),
            (_consumer, (q_smem, qpe_smem, ckv_smem, kpe_smem, p_smem, stats, q_bar, full, empty, p_bar,
                         out_ptr, po_ptr, pml_ptr, pid_t, pid_c, GC, t64, hb, H, nc, start, end, qk_scale,
                         stride_ot, stride_oh, 1, DL, BLOCK_M, BLOCK_N, STAGES)),
            (_producer, (q_ptr, qpe_ptr, kv_ptr, bt_row, q_smem, qpe_smem, ckv_smem, kpe_smem, rows_smem, tree_smem,
                         q_bar, full, empty, t64, hb, H, L, start, end, ident, stride_qt, stride_qh, stride_pt,
                         stride_ph, stride_kv, DL, DR, PAGE, BLOCK_M, BLOCK_N, TREE, STAGES)),
        ], [4, 1], _REGS)
