"""Persistent form of the seesaw Gluon kernel (`_mla_gluon_seesaw`): one program per SM walks its share of the
(query tile, KV chunk) items, so an item's fixed cost (the CTA's start, its query tile and first KV tiles arriving
from memory) overlaps the previous item's last pair and epilogue. Opt-in (`SEESAW_PERSISTENT`,
`mla_attention_triton(..., impl="gluon_seesaw", persistent=True)`). Written in a session without a GPU. It first ran
on an H100 in the thirtieth session: the grid kernel's bits in every GPU test, but 3-14% slower in every bench case,
its tile loop included. The thirty-first found that loop's wgmma descriptors on the vector datapath in the SASS
(see the rows buffer's allocation) and fixed it: 1.4-4.4% slower than the grid kernel with a case-sized block table,
and 1.5-6.7% faster at batch 16 (2-2.5% slower at batch 1) with a serving pool's (`_ssp_total`), on an H100. In
the whole verify step (the thirty-second session, H100, 6 K2.6 layers with the engine's 8192-key rows) it was slower
in all 18 cases, +0.5% to +4.3% (a second run of each: one tie, the rest +0.3% to +4.9%), so it stays off.
`docs/performance.md` has the figures.

Why it may pay where `_mla_gluon_persistent` did not (9-15% slower than its grid form on the H200, 2026-12-05): both
grid kernels hold one CTA per SM (224-227 KB of shared memory), so nothing hides a grid CTA's start and its first
tiles' latency behind other work. In the seesaw, the loads are a producer warp's alone, so it can run into the next
item while the consumers finish the current one, with the consumers' tile loop unchanged (the same `_ss_consumer`,
instruction for instruction, as the grid kernel's); the one-warpgroup persistent kernel had to interleave the next
item's lookups with its own tile loop. A fit of the grid seesaw's times at B 16 / 65 nodes (4k and 32k prefixes) puts
the fixed cost of an item near 8 us, about four tiles' worth, a third of an item at a 4k prefix.

Work items and bits: `_mla_gluon_persistent`'s items (w = pid_c * tiles + pid_t, program k takes w = k, k + NPROG,
...; items with pid_c >= nc are skipped by every partition alike), each computed by the grid kernel's own partition
code on the same bytes in the same order: **the bits are the grid seesaw kernel's**. One option differs: the grid
kernel can skip an odd chunk's phantom tile (`skip_phantom`, `_ss_consumer`'s SKIP_PHANTOM: no load, no S, no
products; the same values), this one always loads it zero-filled and multiplies by it (with the skip, Triton 3.9's
ptxas spills in its tile loop).

What carries over from item to item (`_ss_consumer`'s `ph`, `_ss_tiles`'s `pairs0`):
- the pair count: both stages take one tile per pair (an odd chunk's phantom included), so the `empty` barriers and
  the pair hand-offs (m0, s1, p0) complete once per pair, and their phases are the running pair count's;
- per stage, the parity of the TMA and of the cp.async completions so far (an item's first n_tma tiles come by TMA);
- the item's parity among the program's items: q_bar (the query tile), qpe_bar, fin_bar, tree_bar complete once per
  item.

Buffers reused across items, and what orders each reuse:
- Q's buffer and P0's (which first holds the next query's rope columns): the producer issues the next query tile
  after waiting for the previous item's last release of stage 0. Both consumers release a stage only after the
  wgmmas reading it were waited for, and by then consumer 0's last S and consumer 1's last S and P0 V0R (the last
  readers of Q and of P0) are done.
- The row statistics (m0 / s0 hold the row sums at an item's end): consumer 0 first writes them in the next item
  after waiting on qpe_bar, which consumer 1 arrives on after its epilogue; consumer 1 first writes m1 / s1 / P1 after
  m0_bar, which consumer 0 arrives on after its own epilogue. Each consumer ends an item with a barrier of its
  warpgroup, so none of its threads rewrites a buffer that a slower thread of the same warpgroup still reads.
- The tree table: written per item by consumer 0 (the grid kernel's prologue does it once), then `tree_bar`. The
  producer waits on it before the first tile that reaches the tree part; consumer 0 starts the next item only after
  every tile of this one landed, so after the producer's last read of the table.
`tests/kernels/test_mla_gluon_protocols.py` replays this protocol for runs of items on the CPU.

Needs the query tile by TMA (the launcher keeps the grid kernel otherwise).
"""

from __future__ import annotations

from kernels._mla_gluon import HAVE_GLUON
from kernels._mla_kernels import chunk_span

SEESAW_PERSISTENT = False  # opt-in: the grid seesaw kernel's bits; slower in the verify step (H100, 32nd session)

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from kernels._gluon_compat import cta_barrier
    from kernels._mla_gluon import _check_box, _issue_q, _item_query
    from kernels._mla_gluon_seesaw import _SS_REGS, _ss_consumer, _ss_tiles
    from kernels._mla_gluon_ws import _opaque_zero, _tree_table

    @gluon.jit
    def _ssp_item(w, TILES, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, RULE: gl.constexpr, BLOCK_N: gl.constexpr,
                  NCH: gl.constexpr, C_MIN: gl.constexpr, S_PAD: gl.constexpr, TREE: gl.constexpr, NB: gl.constexpr,
                  BOX: gl.constexpr, L1: gl.constexpr, LB2: gl.constexpr):
        """Item w -> (pid_t, pid_c, hb, t, s, L, bit, nc, start, end, ident, n_tma), as the grid kernel's prologue
        finds them for its program (pid_t, pid_c); the caller skips the item when pid_c >= nc."""
        pid_t = w % TILES
        pid_c = w // TILES
        t, s, L, bit, p = _item_query(pid_t, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, S_PAD, TREE, NB, L1, LB2)
        nc, start, end = chunk_span(p + 1, pid_c, RULE, BLOCK_N, NCH, C_MIN)
        if TREE:
            ident = gl.minimum(end, L)
        else:
            ident = end
        if BOX > 0:
            n_tma = gl.maximum(ident - start, 0) // BLOCK_N
        else:
            n_tma = ident * 0
        return pid_t, pid_c, pid_t % HT, t, s, L, bit, nc, start, end, ident, n_tma

    @gluon.jit
    def _ssp_total(cu_ptr, pre_ptr, S, TILES, GC, RULE: gl.constexpr, BLOCK_N: gl.constexpr, NCH: gl.constexpr,
                   C_MIN: gl.constexpr, S_PAD: gl.constexpr, L1: gl.constexpr):
        """How many items the programs walk: TILES x the chunk count of the launch's longest row, at most GC (the
        grid's chunk slots, sized by the block table's width). Items go chunk-major (w = pid_c * TILES + pid_t), so
        this drops exactly the slots past every row's last chunk, which a serving pool's wide table makes most of a
        short batch's (a 1k row has 2 of 16): each would cost every partition a lookup. A row of session s sits at
        position p < prefix_lens[s] + n_s, and the balanced rule's count does not decrease with the keys; the legacy
        rule's can, so it keeps GC."""
        offs = gl.arange(0, S_PAD, layout=L1)
        m = offs < S
        n = gl.load(cu_ptr + offs + 1, mask=m, other=0) - gl.load(cu_ptr + offs, mask=m, other=0)
        kmax = gl.max(gl.load(pre_ptr + offs, mask=m, other=0) + n, 0)
        if RULE == 0:
            nc = GC
        else:
            nc = gl.minimum(chunk_span(gl.maximum(kmax, 1), 0, RULE, BLOCK_N, NCH, C_MIN)[0], GC)
        return TILES * nc

    @gluon.jit
    def _ssp_producer(kv_ptr, bt_ptr, cu_ptr, pre_ptr, bits_ptr, q_smem, p0_smem, ckv_smem, kpe_smem, rows_smem,
                      tree_smem, q_bar, full_tma, full_cp, empty, tree_bar, desc_l, desc_r, desc_q, desc_qpe, S, H, HT,
                      TILES, GC, NPROG, stride_bits, stride_bt, stride_kv, DL: gl.constexpr, DR: gl.constexpr,
                      PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NCH: gl.constexpr,
                      C_MIN: gl.constexpr, RULE: gl.constexpr, S_PAD: gl.constexpr, TREE: gl.constexpr,
                      NB: gl.constexpr, BOX: gl.constexpr):
        LR: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])  # [BLOCK_N] row lookups, one warp
        L1: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        LB2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0])
        pairs = 0
        ip = 0
        total = _ssp_total(cu_ptr, pre_ptr, S, TILES, GC, RULE, BLOCK_N, NCH, C_MIN, S_PAD, L1)
        for w in range(gl.program_id(0), total, NPROG):
            pid_t, pid_c, hb, t, s, L, bit, nc, start, end, ident, n_tma = _ssp_item(
                w, TILES, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, RULE, BLOCK_N, NCH, C_MIN, S_PAD, TREE, NB,
                BOX, L1, LB2)
            if pid_c < nc:
                # the query tile: its buffers' last readers (both consumers' last S, consumer 1's last P0 V0R) were
                # done when they released stage 0 for the last time (module docstring)
                mbarrier.wait(empty.index(0), (pairs + 1) & 1, pred=pairs >= 1)
                _issue_q(t, hb, H, q_smem.index(0), p0_smem, q_bar, desc_q, desc_qpe, BLOCK_M)
                # rows_smem indexed by an opaque zero of the item: see the allocation
                _ss_tiles(kv_ptr, bt_ptr + s.to(gl.int64) * stride_bt, ckv_smem, kpe_smem,
                          rows_smem.index(_opaque_zero(w)), tree_smem,
                          full_tma, full_cp, empty, desc_l, desc_r, L, start, end, ident, n_tma, pairs, stride_kv,
                          tree_bar, ip, DL, DR, PAGE, BLOCK_N, TREE, BOX, LR, TREE_WAIT=TREE, SKIP_PHANTOM=False)
                pairs += (end - start + 2 * BLOCK_N - 1) // (2 * BLOCK_N)
                ip = ip ^ 1

    @gluon.jit
    def _ssp_consumer(q_smem, p0_smem, p1_smem, ckv_smem, kpe_smem, stats, q_bar, full_tma, full_cp, empty, hand,
                      tree_smem, tree_bar, out_ptr, po_ptr, pml_ptr, nc_ptr, cu_ptr, pre_ptr, bits_ptr, S, H, HT, GC,
                      TILES, NPROG, stride_bits, qk_scale, stride_ot, stride_oh, W: gl.constexpr,
                      DL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NCH: gl.constexpr,
                      C_MIN: gl.constexpr, RULE: gl.constexpr, S_PAD: gl.constexpr, TREE: gl.constexpr,
                      NB: gl.constexpr, BOX: gl.constexpr):
        """Consumer W over the program's items: the grid kernel's `_ss_consumer` per item, with the running phases
        (module docstring); consumer 0 also stores the chunk counts and writes each item's tree table."""
        L1: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        LB2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
        TT: gl.constexpr = NB // BLOCK_N + 1
        pairs = 0
        tb = 0  # bit st: parity of the TMA completions of stage st so far
        cb = 0  # the same for the cp.async completions
        ip = 0
        total = _ssp_total(cu_ptr, pre_ptr, S, TILES, GC, RULE, BLOCK_N, NCH, C_MIN, S_PAD, L1)
        for w in range(gl.program_id(0), total, NPROG):
            pid_t, pid_c, hb, t, s, L, bit, nc, start, end, ident, n_tma = _ssp_item(
                w, TILES, cu_ptr, pre_ptr, bits_ptr, S, HT, stride_bits, RULE, BLOCK_N, NCH, C_MIN, S_PAD, TREE, NB,
                BOX, L1, LB2)
            if pid_c < nc:
                if W == 0:
                    if pid_c == 0:
                        gl.store(nc_ptr + pid_t, nc)  # for the combine kernel
                    if TREE:
                        _tree_table(tree_smem, L, end, bit, NB, BLOCK_N, TREE, TT, LB2)
                        mbarrier.arrive(tree_bar, count=1)  # (after a warpgroup barrier: every warp's stores are in)
                _ss_consumer(q_smem, p0_smem, p1_smem, ckv_smem, kpe_smem, stats, q_bar, full_tma, full_cp, empty,
                             hand, out_ptr, po_ptr, pml_ptr, pid_t, pid_c, GC, t.to(gl.int64), hb, H, nc, start, end,
                             n_tma, qk_scale, stride_ot, stride_oh, (pairs, tb, cb, ip), W, DL, BLOCK_M, BLOCK_N, BOX,
                             SKIP_PHANTOM=False)  # (with the skip its tile loop spills under Triton 3.9's ptxas)
                cta_barrier()  # (this warpgroup's: its threads are done with the row sums before any rewrites them)
                n_pairs = (end - start + 2 * BLOCK_N - 1) // (2 * BLOCK_N)
                t0 = (n_tma + 1) // 2  # this item's TMA tiles in stage 0 (even j < n_tma) and stage 1
                t1 = n_tma // 2
                tb = tb ^ ((t0 & 1) | ((t1 & 1) << 1))
                cb = cb ^ (((n_pairs - t0) & 1) | (((n_pairs - t1) & 1) << 1))
                pairs += n_pairs
                ip = ip ^ 1

    @gluon.jit
    def _mla_fwd_gluon_seesaw_persistent_kernel(
        q_ptr, qpe_ptr, kv_ptr, bt_ptr, cu_ptr, pre_ptr, bits_ptr, out_ptr, po_ptr, pml_ptr, nc_ptr, desc_l, desc_r,
        desc_q, desc_qpe,
        S, H, HT, GC, qk_scale,
        stride_qt, stride_qh, stride_pt, stride_ph, stride_kv, stride_bt, stride_bits, stride_ot, stride_oh,
        TILES, NPROG,
        DL: gl.constexpr, DR: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        NCH: gl.constexpr, C_MIN: gl.constexpr, RULE: gl.constexpr, S_PAD: gl.constexpr, TREE: gl.constexpr,
        NB: gl.constexpr, STAGES: gl.constexpr, BOX: gl.constexpr,
    ):
        """Arguments as `_mla_gluon_seesaw._mla_fwd_gluon_seesaw_kernel` (the query tile always by TMA: desc_q,
        desc_qpe), plus TILES (query tiles of the launch) and NPROG (programs: the grid)."""
        gl.static_assert(BLOCK_M == 64 and BLOCK_N == 64 and DL == 512 and DR == 64 and STAGES == 2)
        _check_box(BOX, PAGE, BLOCK_N)
        gl.static_assert(gl.num_warps() == 4)
        dt: gl.constexpr = kv_ptr.dtype.element_ty
        SH_KV: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DL], dt)
        SH_PE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DR], dt)
        SH_P: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dt)
        SH_1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        TT: gl.constexpr = NB // BLOCK_N + 1

        # --- shared memory: the grid kernel's ---
        q_smem = gl.allocate_shared_memory(dt, [1, BLOCK_M, DL], SH_KV)
        ckv_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DL], SH_KV)
        kpe_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DR], SH_PE)
        p0_smem = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N], SH_P)
        p1_smem = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N], SH_P)
        stats = (gl.allocate_shared_memory(gl.float32, [BLOCK_M], SH_1),
                 gl.allocate_shared_memory(gl.float32, [BLOCK_M], SH_1),
                 gl.allocate_shared_memory(gl.float32, [BLOCK_M], SH_1),
                 gl.allocate_shared_memory(gl.float32, [BLOCK_M], SH_1))
        # [1, ..] and indexed by an opaque zero per item (`_ssp_producer`). With a plain [BLOCK_N] buffer LLVM hoisted
        # the producer's per-lane address of it into the partitions' dispatch preheader, and ptxas (Triton 3.6's)
        # then built every wgmma descriptor of the worker consumer's tile loop on the vector datapath from a
        # shared-memory base held in a vector register: 1137 instructions a pair (160 R2UR) instead of ~800 on the
        # uniform datapath (the grid kernel's: 771 / 832). That is our reading of the PTX and SASS; the compile test
        # checks the tile loops.
        rows_smem = gl.allocate_shared_memory(gl.int32, [1, BLOCK_N], SH_1)
        tree_smem = gl.allocate_shared_memory(gl.int32, [TT, BLOCK_N], SH_1)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        full_tma = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        full_cp = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        hand = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())  # m0, s1, p0, fin, qpe, tree
        mbarrier.init(q_bar, count=1)  # expect_tx + the query tile's two copies
        for i in gl.static_range(STAGES):
            mbarrier.init(full_tma.index(i), count=1)
            mbarrier.init(full_cp.index(i), count=32)
            mbarrier.init(empty.index(i), count=2)
        for i in gl.static_range(6):
            mbarrier.init(hand.index(i), count=2 if i == 3 else 1)
        fence_async_shared()
        # (the partitions start behind a CTA barrier, which orders these barrier inits)

        hands = (hand.index(0), hand.index(1), hand.index(2), hand.index(3), hand.index(4))
        gl.warp_specialize([
            (_ssp_consumer, (q_smem, p0_smem, p1_smem, ckv_smem, kpe_smem, stats, q_bar, full_tma, full_cp, empty,
                             hands, tree_smem, hand.index(5), out_ptr, po_ptr, pml_ptr, nc_ptr, cu_ptr, pre_ptr,
                             bits_ptr, S, H, HT, GC, TILES, NPROG, stride_bits, qk_scale, stride_ot, stride_oh,
                             0, DL, BLOCK_M, BLOCK_N, NCH, C_MIN, RULE, S_PAD, TREE, NB, BOX)),
            (_ssp_consumer, (q_smem, p0_smem, p1_smem, ckv_smem, kpe_smem, stats, q_bar, full_tma, full_cp, empty,
                             hands, tree_smem, hand.index(5), out_ptr, po_ptr, pml_ptr, nc_ptr, cu_ptr, pre_ptr,
                             bits_ptr, S, H, HT, GC, TILES, NPROG, stride_bits, qk_scale, stride_ot, stride_oh,
                             1, DL, BLOCK_M, BLOCK_N, NCH, C_MIN, RULE, S_PAD, TREE, NB, BOX)),
            (_ssp_producer, (kv_ptr, bt_ptr, cu_ptr, pre_ptr, bits_ptr, q_smem, p0_smem, ckv_smem, kpe_smem, rows_smem,
                             tree_smem, q_bar, full_tma, full_cp, empty, hand.index(5), desc_l, desc_r, desc_q,
                             desc_qpe, S, H, HT, TILES, GC, NPROG, stride_bits, stride_bt, stride_kv, DL, DR, PAGE,
                             BLOCK_M, BLOCK_N, NCH, C_MIN, RULE, S_PAD, TREE, NB, BOX)),
        ], [4, 1], _SS_REGS)
