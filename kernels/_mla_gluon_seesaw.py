"""Seesaw Gluon (Hopper) kernel of `kernels.mla_attention` (impl="gluon_seesaw"; what impl="auto" runs on sm_90 since
2026-12-05). Written in a session without a GPU; first run on the H200 three sessions later: every GPU test passed
(reference, batch invariance, tree node == AR step bitwise, bf16 partials) and it was 1.01-1.29x `_mla_gluon` in all 18
cases of the bench (ratio 0.78 at B 16 / 32k / 65 nodes; docs/performance.md, "Twenty-eighth session").

Same work unit, keys, chunks, partials and combine as `_mla_gluon._mla_fwd_gluon_kernel` (a query tile is the 64
heads of one token, a chunk a `chunk_span` of whole 64-key tiles at absolute positions; nc == 1 writes the output,
else the partials that `_mla_combine_kernel` folds in chunk order). What differs is the schedule inside a program,
after FlashMLA's "seesaw" (its 2025-04 deep dive): the output O [64, 512] fp32 is too large for one warpgroup's
registers, so it is split by columns, O_L in consumer 0 and O_R in consumer 1, and the chunk's 64-key tiles are
taken in PAIRS (tile 2i in stage 0, tile 2i + 1 in stage 1; an odd chunk ends with a phantom tile: fully masked, so
its S is -inf, its P zero and its rescale factor 1, and its products add exact zeros; it is zero-filled and multiplied
as any tile, or with SKIP_PHANTOM neither loaded nor multiplied, `_ss_consumer`). Per pair, in base 2 with m the
running row max:

  consumer 0                                       consumer 1
  S0 = Q K0^T (its whole tile, N = 64)             S1 = Q K1^T
  m0 = max(m, rowmax S0), s0 = 2^(m - m0)   ->     (waits m0, s0)  m1 = max(m0, rowmax S1), s1 = 2^(m0 - m1)
  p0 = 2^(S0 - m0), published                ->    p1 = 2^(S1 - m1), published with m1, s1
  O_L = O_L s0 + p0 V0L                            (waits p0)  O_R = O_R s0 + p0 V0R  (tile 2i released)
  (waits s1, p1; tile 2i released)           <-
  O_L = O_L s1 + p1 V1L  (tile 2i + 1 released)    O_R = O_R s1 + p1 V1R  (tile 2i + 1 released)

which is FlashAttention's online softmax over the pair, rearranged so that each warpgroup computes S of a whole
tile (half the shared-memory traffic per S flop of `_mla_gluon`'s split S) and one warpgroup's softmax overlaps the
other's MMAs; only the row max passes from consumer 0 to consumer 1 before consumer 1's softmax. The row sums are
kept per consumer (even / odd tiles, rescaled as O) and added once at the end, consumer 0's first. Both consumers
finish with tile 2i first, so its stage is refilled with tile 2i + 2 (consumer 0's next S) while the rest of the pair
runs; tile 2i + 3 lands while consumer 0 computes S and its softmax, which consumer 1 waits for anyway. (FlashMLA
goes further: 64-column TMA pieces with a barrier each, so that an S starts on the first piece. Tried here in the
forty-sixth session, 681b43b: the same bits, 0.6-5.4% slower in every bench case on an H100: the loop does not wait on
its loads; docs/performance.md.)

Partitions (`gl.warp_specialize`): consumer 0 (the default partition, 4 warps), consumer 1 (4 warps) and a one-warp
producer. The producer loads the query tile (by TMA where the token's heads are rows of one 2D view, `QTMA`; else by
cp.async) and the chunk's tiles: whole committed tiles by TMA (`BOX` > 0: as `_mla_gluon`), the others (ragged
ends, tree ancestors, the phantom) gathered with zero-filling cp.async, each kind on its own barrier per stage
(`full_tma[s]`: the chunk's first n_tma tiles, so tile j completes phase (j // 2) & 1; `full_cp[s]`: phase
((j - n_tma) // 2) & 1). A stage is refilled once both consumers released it (`empty[s]`, two arrivals).

Shared memory (227 KB max): Q's latent 64 KB + 2 KV stages of 72 KB + P0 and P1 8 KB each + row statistics; the
query's rope columns [64, 64] arrive in P0's buffer and each consumer keeps them in registers (the A operand of S's
rope part); consumer 1 says so on `qpe_bar` before consumer 0 first writes P0. Hand-offs (mbarriers, one completion
per pair, phase i & 1): `m0_bar` (m0, s0), `s1_bar` (m1, s1 and P1), `p0_bar` (P0); `fin_bar` (two arrivals)
exchanges the row sums at the end (through m0's and s0's buffers). Every buffer is rewritten only after its reader's
wgmma was waited for (see the comments at each write; tests/kernels/test_mla_gluon_protocols.py replays the protocol
on the CPU). P0 is published unscaled (at m0) as soon as it exists, so consumer 0 keeps no fp32 P alive across the
hand-off (registers), and consumer 1 rescales O_R by s1 between its two products instead.

Value split (VSPLIT 2 or 4, `mla_attention_triton(vsplit=)`; forty-fifth session): the grid's third axis runs VSPLIT
programs per (query tile, chunk), each the whole schedule above for S, the softmax and the row sums, and P V into its
DL / VSPLIT columns only (consumer W of part v: block 2v + W of DL / (2 VSPLIT) columns, `_ss_values`); part 0 stores
the row statistics. More programs for a launch with fewer items than SMs; every column's arithmetic is unchanged (a
warpgroup MMA's sum over the keys does not depend on N: bitwise on the GPU), so the same bits at any VSPLIT. It gains
little (5-12% at batch 1 / 1k on an H100): a program is bound by its own per-tile chain, which still loads every
tile and computes every S.

Determinism: the pairing is by tile index within a chunk, chunks start at absolute positions that depend only on
the row's position, and each tile always goes through the same consumer with the same instructions: results are
batch-invariant and position-aligned within this impl (not bitwise equal to the other impls).
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

    from kernels._gluon_compat import smem_reinterpret
    from kernels._mla_gluon import (
        _ST_HALF_L,
        GLUON_DL,
        _check_box,
        _issue_q,
        _store_partial,
        _tile_boxes,
        _tma_tile,
        fragment_store_layout,
    )
    from kernels._mla_gluon_ws import _copy_query, _copy_rows, _opaque_zero, _pool_rows, _tree_table, _ws_chunk


SEESAW_WARPS = 4  # the launch's num_warps: consumer 0 (the default partition); consumer 1 and the producer are workers
SEESAW_STAGES = 2  # one pair of KV tiles
CONSUMER_REGS = 232  # setmaxnreg of consumer 1 (consumer 0 gets the rest: 232)
PRODUCER_REGS = 48  # the producer warp's warpgroup

if HAVE_GLUON:
    _SS_REGS = gl.constexpr([CONSUMER_REGS, PRODUCER_REGS])
    # a consumer's 16-bit partial O in fragment order (`_store_partial`) at VSPLIT 2 and 4 (VSPLIT 1: _ST_HALF_L)
    _ST_QUARTER_L = gl.constexpr(fragment_store_layout(GLUON_DL // 4, 1))
    _ST_EIGHTH_L = gl.constexpr(fragment_store_layout(GLUON_DL // 8, 1))

    # ----------------------------------------------------------------------------------------- producer

    @gluon.jit
    def _ss_producer(q_ptr, qpe_ptr, kv_ptr, bt_row, q_smem, p0_smem, ckv_smem, kpe_smem, rows_smem, tree_smem,
                     q_bar, full_tma, full_cp, empty, desc_l, desc_r, desc_q, desc_qpe, t, t64, hb, H, L, start, end,
                     ident, n_tma, stride_qt, stride_qh, stride_pt, stride_ph, stride_kv, DL: gl.constexpr,
                     DR: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     TREE: gl.constexpr, BOX: gl.constexpr, QTMA: gl.constexpr, SKIP_PHANTOM: gl.constexpr):
        LR: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])  # [BLOCK_N] row lookups, one warp
        # the query tile: latent columns into Q's buffer, rope columns into P0's (the consumers take them to
        # registers before P0 is first written)
        if QTMA:
            _issue_q(t, hb, H, q_smem.index(0), p0_smem, q_bar, desc_q, desc_qpe, BLOCK_M)
        else:
            _copy_query(q_ptr, qpe_ptr, q_smem.index(0), p0_smem, rows_smem, q_bar, t64, hb, H, stride_qt, stride_qh,
                        stride_pt, stride_ph, DL, DR, BLOCK_M, LR)
        _ss_tiles(kv_ptr, bt_row, ckv_smem, kpe_smem, rows_smem, tree_smem, full_tma, full_cp, empty, desc_l, desc_r,
                  L, start, end, ident, n_tma, 0, stride_kv, q_bar, 0, DL, DR, PAGE, BLOCK_N, TREE, BOX, LR,
                  SKIP_PHANTOM=SKIP_PHANTOM)

    @gluon.jit
    def _ss_tiles(kv_ptr, bt_row, ckv_smem, kpe_smem, rows_smem, tree_smem, full_tma, full_cp, empty, desc_l, desc_r,
                  L, start, end, ident, n_tma, pairs0, stride_kv, tree_bar, ip, DL: gl.constexpr, DR: gl.constexpr,
                  PAGE: gl.constexpr, BLOCK_N: gl.constexpr, TREE: gl.constexpr, BOX: gl.constexpr, LR: gl.constexpr,
                  TREE_WAIT: gl.constexpr = False, SKIP_PHANTOM: gl.constexpr = True):
        """The producer's loads of one (query tile, chunk)'s KV tiles. `pairs0`: pairs the program's stages went
        through before it (0 in the grid kernel; the persistent kernel's running count), so tile j of the item is
        the (pairs0 + j // 2)-th tile of its stage. TREE_WAIT (persistent kernel): the tree table is consumer 0's
        per item, so the first tile that reaches the tree part waits for it on `tree_bar` (phase: the item's
        parity `ip`). SKIP_PHANTOM (as `_ss_consumer`'s): the phantom tile of an odd chunk is not loaded."""
        n_tiles = (end - start + BLOCK_N - 1) // BLOCK_N
        for j in range(2 * ((n_tiles + 1) // 2)):  # pairs; an odd chunk ends with a phantom (all rows masked)
            k0 = start + j * BLOCK_N
            st = j % 2
            # stage st is free once both consumers released the tile before this one in it (the previous phase of
            # its `empty` barrier)
            mbarrier.wait(empty.index(st), (pairs0 + j // 2 + 1) & 1, pred=pairs0 * 2 + j >= 2)
            if BOX > 0 and j < n_tma:
                _tma_tile(_tile_boxes(k0, end, bt_row, PAGE, BOX), ckv_smem.index(st), kpe_smem.index(st),
                          full_tma.index(st), desc_l, desc_r, DL, BOX)
            else:
                if TREE_WAIT:  # before the first tile that reads the tree table (consumer 0 writes it per item)
                    mbarrier.wait(tree_bar, ip, pred=(end > L) & (j == gl.maximum(ident - start, 0) // BLOCK_N))
                if not SKIP_PHANTOM:  # (the phantom zero-filled)
                    _ss_gather(k0, end, ident, L, bt_row, ckv_smem.index(st), kpe_smem.index(st), kv_ptr, stride_kv,
                               rows_smem, tree_smem, DL, DR, PAGE, BLOCK_N, TREE, LR)
                elif k0 < end:  # not the phantom tile of an odd chunk, which no consumer reads (`_ss_consumer`)
                    _ss_gather(k0, end, ident, L, bt_row, ckv_smem.index(st), kpe_smem.index(st), kv_ptr, stride_kv,
                               rows_smem, tree_smem, DL, DR, PAGE, BLOCK_N, TREE, LR)
                # each lane: when its copies landed (the phantom's arrival keeps the stage's phases as they were)
                cp.mbarrier_arrive(full_cp.index(st), increment_count=False)

    @gluon.jit
    def _ss_gather(k0, end, ident, L, bt_row, ckv_dst, kpe_dst, kv_ptr, stride_kv, rows_smem, tree_smem,
                   DL: gl.constexpr, DR: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, TREE: gl.constexpr,
                   LR: gl.constexpr):
        """The producer's cp.async copies of the tile at key k0 (its rows looked up, rows past `end` zero-filled)."""
        _pool_rows(k0, end, ident, L, bt_row, rows_smem, tree_smem, PAGE, BLOCK_N, TREE, LR, True)
        _copy_rows(ckv_dst, kpe_dst, kv_ptr, kv_ptr + DL, stride_kv, stride_kv, rows_smem, end - k0, DL, DR, BLOCK_N)

    # ----------------------------------------------------------------------------------------- consumers

    @gluon.jit
    def _ss_wait(j, n_tma, full_tma, full_cp, ph, BOX: gl.constexpr):
        """Wait until tile j (stage j % 2) landed, then make it visible to wgmma. `ph` (`_ss_consumer`): bit st of
        ph[1] / ph[2] is the parity of the TMA / cp.async completions stage st had before this item."""
        st = j % 2
        if BOX > 0 and j < n_tma:
            mbarrier.wait(full_tma.index(st), ((j // 2) ^ (ph[1] >> st)) & 1)
        else:
            mbarrier.wait(full_cp.index(st), (((j - n_tma) // 2) ^ (ph[2] >> st)) & 1)
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async proxy

    @gluon.jit
    def _ss_scores(j, q_smem, qpe, ckv_smem, kpe_smem, start, end, qk_scale, S_L: gl.constexpr,
                   BLOCK_N: gl.constexpr):
        """S of our tile j (stage j % 2) in the log2 domain, -inf past the chunk's end."""
        z = _opaque_zero(j)
        st = z + j % 2  # (opaque too: a consumer's stage is a constant, and its hoisted descriptors would spill)
        sc = gl.zeros([qpe.shape[0], BLOCK_N], gl.float32, layout=S_L)
        sc = warpgroup_mma(q_smem.index(z), ckv_smem.index(st).permute((1, 0)), sc, use_acc=False, is_async=True)
        sc = warpgroup_mma(qpe, kpe_smem.index(st).permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma_wait(0, deps=(sc, qpe))[0]
        pos = start + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
        return gl.where(gl.expand_dims(pos < end, 0), sc * qk_scale, float("-inf"))

    @gluon.jit
    def _ss_values(ckv_smem, st, blk, V_OFF, HALF: gl.constexpr, VSPLIT: gl.constexpr):
        """The B operand of a consumer's PV: value columns V_OFF .. V_OFF + HALF - 1 (block `blk` of HALF) of stage
        st's tile. VSPLIT == 1: a constant slice, as before the split. Else `blk` depends on the program, and a slice
        takes constant offsets only, so the stages are viewed as [STAGES * DL / HALF, BLOCK_N, HALF] blocks and
        indexed: in the 128-byte-swizzled layout of [BLOCK_N, DL] 16-bit tiles, each 64 columns are one contiguous
        [BLOCK_N, 64] block, so block b of HALF (a multiple of 64) columns starts b * BLOCK_N * HALF elements in, and
        is laid out as a [BLOCK_N, HALF] tile of the same layout (checked in the compile tests)."""
        if VSPLIT == 1:
            return ckv_smem.index(st).slice(V_OFF, HALF, dim=1)
        else:
            gl.static_assert(HALF % 64 == 0)
            NBLK: gl.constexpr = ckv_smem.shape[2] // HALF
            SH_V: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ckv_smem.shape[1], HALF], ckv_smem.dtype)
            blocks = smem_reinterpret(ckv_smem, ckv_smem.dtype, [ckv_smem.shape[0] * NBLK, ckv_smem.shape[1], HALF],
                                      SH_V)
            return blocks.index(st * NBLK + blk)

    @gluon.jit
    def _ss_consumer(q_smem, p0_smem, p1_smem, ckv_smem, kpe_smem, stats, q_bar, full_tma, full_cp, empty, hand,
                     out_ptr, po_ptr, pml_ptr, pid_t, pid_c, GC, t64, hb, H, nc, start, end, n_tma, qk_scale,
                     stride_ot, stride_oh, ph, W: gl.constexpr, DL: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, BOX: gl.constexpr, pid_v=0, VSPLIT: gl.constexpr = 1,
                     SKIP_PHANTOM: gl.constexpr = True):
        """Consumer W: S and the softmax of tile 2i + W of every pair, PV of both tiles into its value columns
        (module docstring), for one (query tile, chunk). `ph` = (pairs before it, TMA and cp.async parities per stage
        as bit masks (`_ss_wait`), its parity among the program's items): all 0 in the grid kernel; the persistent
        kernel's running counts. VSPLIT: the programs the tile's DL value columns are split over (`pid_v` this one's
        part); consumer W owns block 2 pid_v + W of DL / (2 VSPLIT) columns. S, the softmax and the row sums are
        the whole tile's in every part, so each column gets the same arithmetic at any VSPLIT (module docstring).
        SKIP_PHANTOM: an odd chunk's last pair computes neither S of its phantom tile (all -inf: every key is past the
        chunk's end) nor the products with its P1 (all zero), so the producer need not load it. The running max,
        rescale factors and row sums come out as the products would make them (max(m0, -inf) = m0, 2^0 = 1, a sum
        of zeros), and O as O * s1 without the product's exact zeros added: the same values (the sign of an exact
        -0.0 in O and the MMA's handling of fp32 subnormals aside), and for the AR step at a position as for a tree
        node there (chunks depend on the position only). Off: the products with a zero-filled phantom, as before
        the forty-eighth session (the persistent kernel: its tile loop spills with the skip under Triton 3.9)."""
        pair0 = ph[0]
        ip = ph[3]
        HALF: gl.constexpr = DL // (2 * VSPLIT)  # value columns per consumer
        if VSPLIT == 1:  # (constants: a slice of shared memory takes constant offsets)
            blk: gl.constexpr = W
            V_OFF: gl.constexpr = W * HALF
        else:
            blk = pid_v * 2 + W  # our block of HALF columns
            V_OFF = blk * HALF
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HALF, 16])
        RS: gl.constexpr = gl.SliceLayout(1, S_L)  # one value per query row
        m0_smem, s0_smem, m1_smem, s1_smem = stats
        m0_bar, s1_bar, p0_bar, fin_bar, qpe_bar = hand
        n_pairs = (end - start + 2 * BLOCK_N - 1) // (2 * BLOCK_N)
        mbarrier.wait(q_bar, ip)
        fence_async_shared()
        # the query's rope columns, kept as the A operand of S's rope part (their buffer becomes P0's)
        qpe = p0_smem.load(gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2))
        if W == 1:
            mbarrier.arrive(qpe_bar, count=1)  # our copy of the rope columns is in registers
        else:
            mbarrier.wait(qpe_bar, ip)  # consumer 1's too: P0's buffer is ours to write
        m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=RS)
        li = gl.zeros([BLOCK_M], gl.float32, layout=RS)  # row sums of our tiles, at the running max m
        o = gl.zeros([BLOCK_M, HALF], gl.float32, layout=O_L)
        for i in range(n_pairs):
            j = 2 * i + W
            z = _opaque_zero(i)  # stage 0 = ckv_smem.index(z), stage 1 = .index(z + 1): see _ss_scores
            _ss_wait(j, n_tma, full_tma, full_cp, ph, BOX)
            if SKIP_PHANTOM:
                real1 = start + (2 * i + 1) * BLOCK_N < end  # tile 2i + 1 holds keys (else: an odd chunk's phantom)
            else:
                real1: gl.constexpr = True
            if W == 0:
                sc = _ss_scores(j, q_smem, qpe, ckv_smem, kpe_smem, start, end, qk_scale, S_L, BLOCK_N)
            elif real1:
                sc = _ss_scores(j, q_smem, qpe, ckv_smem, kpe_smem, start, end, qk_scale, S_L, BLOCK_N)
            else:  # the phantom's S, as the product would give it (every key past the chunk's end), not computed
                sc = gl.full([BLOCK_M, BLOCK_N], float("-inf"), gl.float32, layout=S_L)
            mp = gl.max(sc, 1)
            if W == 0:
                m_new = gl.maximum(m, mp)
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
                s0 = gl.exp2(m - m_use)
                m0_smem.store(m_new)
                s0_smem.store(s0)
                mbarrier.arrive(m0_bar, count=1)  # (after a warpgroup barrier: every warp's stores are in)
                pr = gl.exp2(sc - gl.expand_dims(m_use, 1))
                rs = gl.sum(pr, 1)
                pb = pr.to(p0_smem.dtype)
                # P0 (at m0) for consumer 1. P0's buffer: consumer 1's last read of it, the previous pair's P0 V0R,
                # was waited for before it released stage 0, i.e. before tile 2i landed there (waited above); the
                # query's rope columns, before it arrived on qpe_bar (waited before the loop)
                p0_smem.store(pb)
                fence_async_shared()  # read by consumer 1's wgmma (async proxy)
                mbarrier.arrive(p0_bar, count=1)
                pa = gl.convert_layout(pb, gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2))
                o = o * gl.expand_dims(gl.convert_layout(s0, gl.SliceLayout(1, O_L)), 1)
                o = warpgroup_mma(pa, _ss_values(ckv_smem, z, blk, V_OFF, HALF, VSPLIT), o, is_async=True)  # P0 V0L
                mbarrier.wait(s1_bar, (pair0 + i) & 1)  # m1, s1 and P1 are in (consumer 1 read m0, s0: ours to rewrite)
                m1 = m1_smem.load(RS)
                s1 = s1_smem.load(RS)
                li = (li * s0 + rs) * s1
                o = warpgroup_mma_wait(0, deps=(o, pa))[0]
                mbarrier.arrive(empty.index(0), count=1)  # our reads of tile 2i are done (S0, P0 V0L)
                _ss_wait(j + 1, n_tma, full_tma, full_cp, ph, BOX)  # tile 2i + 1 landed (consumer 1 waited already)
                o = o * gl.expand_dims(gl.convert_layout(s1, gl.SliceLayout(1, O_L)), 1)
                if real1:  # (a phantom's P1 is zero: its product would add exact zeros)
                    o = warpgroup_mma(p1_smem, _ss_values(ckv_smem, z + 1, blk, V_OFF, HALF, VSPLIT), o,
                                      is_async=True)  # P1 V1L
                    o = warpgroup_mma_wait(0, deps=(o,))
                mbarrier.arrive(empty.index(1), count=1)  # and of tile 2i + 1 (P1 V1L)
                m = m1
            else:
                mbarrier.wait(m0_bar, (pair0 + i) & 1)
                m0 = m0_smem.load(RS)
                s0 = s0_smem.load(RS)
                m_new = gl.maximum(m0, mp)
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
                s1 = gl.exp2(m0 - m_use)
                pr = gl.exp2(sc - gl.expand_dims(m_use, 1))
                # P1's buffer: consumer 0's last read of it (the previous pair's PV) was waited for before it
                # published m0
                p1_smem.store(pr.to(p1_smem.dtype))
                m1_smem.store(m_new)
                s1_smem.store(s1)
                fence_async_shared()
                mbarrier.arrive(s1_bar, count=1)
                rs = gl.sum(pr, 1)
                li = li * (s0 * s1) + rs
                pa = gl.convert_layout(pr.to(p1_smem.dtype), gl.DotOperandLayout(operand_index=0, parent=O_L,
                                                                                   k_width=2))
                # tile 2i's product first (O_R at m0), so that its stage is refilled while the rest of the pair runs
                o = o * gl.expand_dims(gl.convert_layout(s0, gl.SliceLayout(1, O_L)), 1)
                mbarrier.wait(p0_bar, (pair0 + i) & 1)
                _ss_wait(j - 1, n_tma, full_tma, full_cp, ph, BOX)  # tile 2i landed (consumer 0 waited already)
                o = warpgroup_mma(p0_smem, _ss_values(ckv_smem, z, blk, V_OFF, HALF, VSPLIT), o,
                                  is_async=True)  # P0 V0R
                o = warpgroup_mma_wait(0, deps=(o,))
                mbarrier.arrive(empty.index(0), count=1)  # our reads of tile 2i are done (P0 V0R)
                o = o * gl.expand_dims(gl.convert_layout(s1, gl.SliceLayout(1, O_L)), 1)  # O_R at m1
                if real1:
                    o = warpgroup_mma(pa, _ss_values(ckv_smem, z + 1, blk, V_OFF, HALF, VSPLIT), o,
                                      is_async=True)  # P1 V1R
                    o = warpgroup_mma_wait(0, deps=(o, pa))[0]
                mbarrier.arrive(empty.index(1), count=1)  # and of tile 2i + 1 (S1, P1 V1R)
                m = m_new

        # the row sums: consumer 0's (even tiles) + consumer 1's (odd tiles), through the buffers of m0 and s0, the
        # two that consumer 0 wrote last and consumer 1 read last (before it arrived on s1_bar, which consumer 0
        # waited for). Not m1 / s1: consumer 0 may still be reading the last pair's while consumer 1 gets here.
        if W == 0:
            s0_smem.store(li)
        else:
            m0_smem.store(li)
        mbarrier.arrive(fin_bar, count=1)
        mbarrier.wait(fin_bar, ip)
        li = s0_smem.load(RS) + m0_smem.load(RS)
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
            if VSPLIT == 1:  # the 16-bit store layout of HALF columns
                ST_L: gl.constexpr = _ST_HALF_L
            elif VSPLIT == 2:
                ST_L: gl.constexpr = _ST_QUARTER_L
            else:
                ST_L: gl.constexpr = _ST_EIGHTH_L
            _store_partial(po_ptr, part, o, BLOCK_M, DL, HALF, V_OFF, O_L, ST_L)
            if W == 0:
                rs_ = gl.arange(0, BLOCK_M, layout=RS)
                if VSPLIT == 1:
                    gl.store(pml_ptr + part * (2 * BLOCK_M) + rs_, m)
                    gl.store(pml_ptr + part * (2 * BLOCK_M) + BLOCK_M + rs_, li)
                else:  # the row statistics: every part has them, part 0 stores them
                    first = rs_ < BLOCK_M - pid_v * BLOCK_M
                    gl.store(pml_ptr + part * (2 * BLOCK_M) + rs_, m, mask=first)
                    gl.store(pml_ptr + part * (2 * BLOCK_M) + BLOCK_M + rs_, li, mask=first)

    # ----------------------------------------------------------------------------------------- kernel

    @gluon.jit
    def _mla_fwd_gluon_seesaw_kernel(
        q_ptr, qpe_ptr, kv_ptr, bt_ptr, cu_ptr, pre_ptr, bits_ptr, out_ptr, po_ptr, pml_ptr, nc_ptr, desc_l, desc_r,
        desc_q, desc_qpe,
        S, H, HT, GC, qk_scale,
        stride_qt, stride_qh, stride_pt, stride_ph, stride_kv, stride_bt, stride_bits, stride_ot, stride_oh,
        DL: gl.constexpr, DR: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        NCH: gl.constexpr, C_MIN: gl.constexpr, RULE: gl.constexpr, S_PAD: gl.constexpr, TREE: gl.constexpr,
        NB: gl.constexpr, STAGES: gl.constexpr, BOX: gl.constexpr, QTMA: gl.constexpr, VSPLIT: gl.constexpr = 1,
        SKIP_PHANTOM: gl.constexpr = True,
    ):
        """Arguments as `_mla_gluon._mla_fwd_gluon_kernel`. The prologue (consumer 0's warps) finds the query row
        and chunk, resolves the tree tiles' rows and sets up shared memory; then the partitions. VSPLIT (1, 2 or 4):
        the programs along the grid's third axis that split each (query tile, chunk)'s value columns. SKIP_PHANTOM:
        an odd chunk's phantom tile is neither loaded nor multiplied (`_ss_consumer`; the same values)."""
        gl.static_assert(BLOCK_M == 64 and BLOCK_N == 64 and DL == 512 and DR == 64 and STAGES == 2)
        gl.static_assert(VSPLIT == 1 or VSPLIT == 2 or VSPLIT == 4)
        _check_box(BOX, PAGE, BLOCK_N)
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
        if BOX > 0:  # the chunk's first tiles whose keys are all committed rows (identity-mapped, all visible)
            n_tma = gl.maximum(ident - start, 0) // BLOCK_N
        else:
            n_tma = ident * 0

        # --- shared memory ---
        q_smem = gl.allocate_shared_memory(dt, [1, BLOCK_M, DL], SH_KV)  # [1, ..]: see _mla_gluon_ws._opaque_zero
        ckv_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DL], SH_KV)
        kpe_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, DR], SH_PE)
        p0_smem = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N], SH_P)  # first the query's rope columns
        p1_smem = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N], SH_P)
        stats = (gl.allocate_shared_memory(gl.float32, [BLOCK_M], SH_1),  # m0 (at the end: consumer 1's row sums)
                 gl.allocate_shared_memory(gl.float32, [BLOCK_M], SH_1),  # s0 (at the end: consumer 0's row sums)
                 gl.allocate_shared_memory(gl.float32, [BLOCK_M], SH_1),  # m1
                 gl.allocate_shared_memory(gl.float32, [BLOCK_M], SH_1))  # s1
        rows_smem = gl.allocate_shared_memory(gl.int32, [BLOCK_N], SH_1)  # the producer's current pool rows
        tree_smem = gl.allocate_shared_memory(gl.int32, [TT, BLOCK_N], SH_1)  # logical rows of the tree tiles
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        full_tma = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        full_cp = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        hand = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())  # m0, s1, p0, fin, qpe
        if QTMA:
            mbarrier.init(q_bar, count=1)  # expect_tx + the query tile's two copies
        else:
            mbarrier.init(q_bar, count=32)  # the producer warp's lanes (cp.async.mbarrier.arrive.noinc)
        for i in gl.static_range(STAGES):
            mbarrier.init(full_tma.index(i), count=1)
            mbarrier.init(full_cp.index(i), count=32)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        for i in gl.static_range(5):
            mbarrier.init(hand.index(i), count=2 if i == 3 else 1)
        fence_async_shared()
        _tree_table(tree_smem, L, end, bit, NB, BLOCK_N, TREE, TT, LB2)
        # (the partitions start behind a CTA barrier, which orders these barrier inits and table stores)

        t64 = t.to(gl.int64)
        bt_row = bt_ptr + s.to(gl.int64) * stride_bt
        hands = (hand.index(0), hand.index(1), hand.index(2), hand.index(3), hand.index(4))
        if VSPLIT == 1:
            pid_v = 0
        else:
            pid_v = gl.program_id(2)
        gl.warp_specialize([
            (_ss_consumer, (q_smem, p0_smem, p1_smem, ckv_smem, kpe_smem, stats, q_bar, full_tma, full_cp, empty,
                            hands, out_ptr, po_ptr, pml_ptr, pid_t, pid_c, GC, t64, hb, H, nc, start, end, n_tma,
                            qk_scale, stride_ot, stride_oh, (0, 0, 0, 0), 0, DL, BLOCK_M, BLOCK_N, BOX, pid_v,
                            VSPLIT, SKIP_PHANTOM)),
            (_ss_consumer, (q_smem, p0_smem, p1_smem, ckv_smem, kpe_smem, stats, q_bar, full_tma, full_cp, empty,
                            hands, out_ptr, po_ptr, pml_ptr, pid_t, pid_c, GC, t64, hb, H, nc, start, end, n_tma,
                            qk_scale, stride_ot, stride_oh, (0, 0, 0, 0), 1, DL, BLOCK_M, BLOCK_N, BOX, pid_v,
                            VSPLIT, SKIP_PHANTOM)),
            (_ss_producer, (q_ptr, qpe_ptr, kv_ptr, bt_row, q_smem, p0_smem, ckv_smem, kpe_smem, rows_smem, tree_smem,
                            q_bar, full_tma, full_cp, empty, desc_l, desc_r, desc_q, desc_qpe, t, t64, hb, H, L,
                            start, end, ident, n_tma, stride_qt, stride_qh, stride_pt, stride_ph, stride_kv, DL, DR,
                            PAGE, BLOCK_M, BLOCK_N, TREE, BOX, QTMA, SKIP_PHANTOM)),
        ], [4, 1], _SS_REGS)
