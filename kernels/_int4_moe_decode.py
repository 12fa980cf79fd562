"""Gluon (sm_90) kernel of `kernels.int4_moe_wgmma`'s fused decode: one token's routed-expert layer (w13, w2 and
the combine) as one persistent launch that schedules the same ring GEMM tiles (`_int4_moe_wgmma._ring_gemm`) as the
separate launches, with device-side counters between them (`_moe_decode_kernel`'s docstring)."""

from __future__ import annotations

DECODE_MAXNREG = {128: None, 64: 128}  # the fused decode kernel's register cap by program rows: 2 / 4 CTAs per SM

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from kernels._gluon_compat import cta_barrier
    from kernels._int4_moe_wgmma import (
        _CS_L1,
        _CS_L64,
        _S_SL,
        _W_L1,
        _W_SL,
        HAVE_GLUON,
        _combine_rows,
        _fence_gpu,
        _prefetch_w,
        _publish,
        _ring_gemm,
        _weight_src,
    )
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

if HAVE_GLUON:

    @gluon.jit
    def _moe_decode_kernel(
        x_ptr,  # bf16 [1, Kp13]: the token
        w13_ptr, s13_ptr, w2_ptr, s2_ptr,  # "wgmma" layout
        a_ptr,  # bf16 [TOPK, Kp2]: silu(gate) * up per slot (written here)
        y_ptr,  # fp32 [TOPK, D]: each slot's expert output, unweighted (written here)
        out_ptr,  # [1, D]
        ids_ptr,  # int64 [TOPK]: the token's experts
        tw_ptr,  # [TOPK]: its routing weights
        sync_ptr,  # int32 [SYNC_WORDS], zero at launch, zero again at exit: ticket, exits, ready[TOPK], rows_done[]
        I, D, kb13, kb2, stride_x, stride_a, stride_y,
        stride_w13e, stride_w13n, stride_w13k, stride_s13e8, stride_s13n8, stride_s13k8,
        stride_w2e, stride_w2n, stride_w2k, stride_s2e8, stride_s2n8, stride_s2k8,  # _k / _k8: between K steps
        TOPK: gl.constexpr, STAGES: gl.constexpr, ROW_TILES: gl.constexpr, R: gl.constexpr,
    ):
        """One token's whole routed-expert layer in one persistent launch (decode): w13, w2 and the combine.

        Work items, handed out in order by a ticket counter: first the TOPK x cdiv(I, R / 2) w13 tiles (slot-major),
        then the cdiv(D, R ROW_TILES) x TOPK w2 tiles (row-major, so each row range's slots finish together). A
        w13 tile stores its R / 2 columns of `a` and counts itself in ready[slot]; a w2 tile puts its first weight steps
        in flight, waits until ready[slot] has every w13 tile of its slot, runs, and counts itself in its row range's
        rows_done; the CTA that completes a row range (the TOPK-th) combines it. No deadlock whatever the residency:
        a w2 tile only waits for w13 tiles, whose tickets all went out before any w2 ticket to CTAs already running.
        The last CTA to leave zeroes the counters for the next launch (stream order makes that visible to it).

        Each tile runs the same `_ring_gemm` (8-pair N, one pair in slot 0; R weight rows a program) with the same K
        order as the separate decode launches, and the combine adds the slots in the same order: the same bits."""
        NP: gl.constexpr = 8
        CW_L: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])  # [R rows, 32 words]
        if R == 128:
            CS_L: gl.constexpr = _CS_L1
        else:
            CS_L: gl.constexpr = _CS_L64
        X_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([4 * NP, 64], gl.bfloat16)
        xring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 4 * NP, 64], X_SL)
        wring = gl.allocate_shared_memory(gl.int32, [STAGES, R, 32], _W_SL)
        sring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, R, 8], _S_SL)

        n_r13 = gl.cdiv(I, R // 2)
        n13 = TOPK * n_r13
        n_all = n13 + TOPK * gl.cdiv(D, R * ROW_TILES)
        ready_ptr = sync_ptr + 2
        rows_ptr = sync_ptr + 2 + TOPK
        item = gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
        while item < n_all:
            cta_barrier()  # every warp is done with the previous tile's ring slots
            if item < n13:
                k = item // n_r13
                r = item % n_r13
                e = gl.load(ids_ptr + k).to(gl.int32)
                w_src, w_ok, s_src, s_ok, gw, gs = _weight_src(w13_ptr, s13_ptr, e, r, I, stride_w13e, stride_w13n,
                                                               stride_s13e8, stride_s13n8, True, 1, CW_L, CS_L, R)
                _ring_gemm(x_ptr, a_ptr, ids_ptr, k, r, TOPK, I, kb13, stride_x, stride_a, w_src, w_ok, s_src, s_ok,
                           gw, gs, stride_w13n, stride_s13n8, stride_w13k, stride_s13k8, xring, wring, sring, TOPK,
                           True, NP, NP, STAGES, False, True, 1, _W_L1, CW_L, CS_L, 1)
                _publish()
                gl.atomic_add(ready_ptr + k, 1, sem="release", scope="gpu")
            else:
                j = item - n13
                r = j // TOPK
                k = j % TOPK
                e = gl.load(ids_ptr + k).to(gl.int32)
                w_src, w_ok, s_src, s_ok, gw, gs = _weight_src(w2_ptr, s2_ptr, e, r, D, stride_w2e, stride_w2n,
                                                               stride_s2e8, stride_s2n8, False, ROW_TILES, CW_L,
                                                               CS_L, R)
                _prefetch_w(w_src, w_ok, s_src, s_ok, gw, gs, D, kb2, stride_w2n, stride_s2n8, stride_w2k, stride_s2k8,
                            wring, sring, STAGES, ROW_TILES, CW_L, CS_L)
                got = gl.atomic_add(ready_ptr + k, 0, sem="acquire", scope="gpu")
                while got < n_r13:
                    got = gl.atomic_add(ready_ptr + k, 0, sem="acquire", scope="gpu")
                _fence_gpu()
                _ring_gemm(a_ptr, y_ptr, ids_ptr, k, r, TOPK, D, kb2, stride_a, stride_y, w_src, w_ok, s_src, s_ok,
                           gw, gs, stride_w2n, stride_s2n8, stride_w2k, stride_s2k8, xring, wring, sring, TOPK, False,
                           NP, NP, STAGES, True, True, ROW_TILES, _W_L1, CW_L, CS_L, 1)
                _publish()
                if gl.atomic_add(rows_ptr + r, 1, sem="acq_rel", scope="gpu") == TOPK - 1:
                    _fence_gpu()
                    _combine_rows(y_ptr, tw_ptr, out_ptr, r * (R * ROW_TILES), D, stride_y, TOPK, R * ROW_TILES)
            item = gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
        if gl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == gl.num_programs(0) - 1:
            Z_L: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
            zi = gl.arange(0, 256, layout=Z_L)
            gl.store(sync_ptr + zi, gl.zeros([256], gl.int32, Z_L), mask=zi < 2 + TOPK + n_all - n13)
