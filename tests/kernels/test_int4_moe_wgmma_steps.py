"""The "wgmma_steps" layout of the wgmma INT4 MoE path: the "wgmma" words and scales, each expert's in step-major
order (kernels/int4_moe_wgmma.py's module doc).

CPU: the layout is a bit-exact reordering (it inverts, it decodes to the checkpoint's weights), a program's rows of
one K step are one contiguous run, and the strides the launcher hands the kernels address, for every (expert, row,
step, word), the word the "wgmma" layout holds there (the kernels' own address arithmetic, replayed in torch); bad
tensors are refused. GPU (marked `gpu`, sm_90 only): against the reference at awkward shapes, and bitwise equal to
the "wgmma" layout at Kimi K2.6 shapes for every kind of launch (same arithmetic in the same order).
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernels.int4_moe import int4_moe
from kernels.int4_moe_wgmma import (
    _layout_strides,
    from_step_major,
    int4_moe_wgmma,
    repack_int4_moe_for_wgmma,
    repack_int4_moe_for_wgmma_steps,
    to_step_major,
    wgmma_dense_experts,
    wgmma_steps_dense_experts,
)
from kernels.int4_pack import dequantize_int4
from tests.kernels.test_int4_moe import (
    KIMI,
    assert_bitwise,
    check_layout_path,
    make_experts,
    make_routing,
    run_poisoned,
)
from tests.kernels.test_int4_moe_wgmma import kimi_wgmma, sm90  # noqa: F401 - kimi_wgmma: the fixture kimi_both asks for


@pytest.mark.parametrize("D,inter", [(544, 96), (256, 32), (1056, 160)])
def test_step_major_reorders_words_and_scales(D, inter):
    """to_step_major: word w of step kb of row n at (kb N + n) 32 + w of its expert, its scales likewise; the
    inverse gives the "wgmma" tensors back bit for bit; the load's repack (written step-major expert by expert) is
    the same as to_step_major of the "wgmma" tensors; both decode to the checkpoint's weights."""
    w = make_experts(3, D, inter, device="cpu", seed=11)
    wg = repack_int4_moe_for_wgmma(*w)
    steps = repack_int4_moe_for_wgmma_steps(*w)
    for (words, scale), (sw, ss) in zip((wg[:2], wg[2:]), (steps[:2], steps[2:])):
        E, N, kw = words.shape
        kb = kw // 32
        assert sw.shape == words.shape and ss.shape == scale.shape and sw.is_contiguous() and ss.is_contiguous()
        flat_w, flat_s = sw.reshape(E, -1), ss.reshape(E, -1)
        for e, n, b in ((0, 0, 0), (E - 1, N - 1, kb - 1), (1, N // 3, kb // 2), (2, 5, kb - 1)):
            at = (b * N + n)
            assert torch.equal(flat_w[e, at * 32:(at + 1) * 32], words[e, n, b * 32:(b + 1) * 32]), (e, n, b)
            assert torch.equal(flat_s[e, at * 8:(at + 1) * 8], scale[e, n, b * 8:(b + 1) * 8]), (e, n, b)
        back = from_step_major(sw, ss)
        assert torch.equal(back[0], words) and torch.equal(back[1], scale)
        again = to_step_major(words, scale)
        assert torch.equal(again[0], sw) and torch.equal(again[1], ss)
    a, b = wgmma_dense_experts(*wg, D), wgmma_steps_dense_experts(*steps, D)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ref13 = torch.stack([dequantize_int4(w[0][e], w[1][e], torch.float32) for e in range(3)])
    assert torch.equal(b[0], ref13)


def kernel_read(t: torch.Tensor, strides: tuple[int, ...], rows: torch.Tensor, kb: int) -> torch.Tensor:
    """Step kb of each of `rows` of every expert of t (words: 32 of them, `strides` the launcher's three in words;
    scales: 8, the three in 16-byte units), read as `_int4_moe_wgmma._copy_w` reads them: expert e * stride_e +
    row * stride_n + kb * stride_k + column, in the tensor's storage (both layouts' tensors are contiguous here)."""
    width = 32 if t.dtype == torch.int32 else 8
    unit = 1 if width == 32 else 8
    se, sn, sk = (v * unit for v in strides)
    e = torch.arange(t.shape[0]).view(-1, 1, 1)
    return t.reshape(-1)[e * se + rows.view(1, -1, 1) * sn + kb * sk + torch.arange(width).view(1, 1, -1)]


@pytest.mark.parametrize("D,inter", [(544, 96), (1056, 160)])
def test_kernel_addressing_reads_the_same_weights_in_both_layouts(D, inter):
    """For every row and K step, the kernels' addressing with `_layout_strides` finds the same words and scales in
    "wgmma_steps" as in "wgmma" (also for an expert range, as expert parallelism holds); and a w13 program's gate
    rows of one step are one contiguous run in "wgmma_steps" (the point of the layout), 64 runs in "wgmma"."""
    w = make_experts(4, D, inter, device="cpu", seed=12)
    wg = repack_int4_moe_for_wgmma(*w)
    steps = repack_int4_moe_for_wgmma_steps(*w)
    for lo, hi in ((0, 4), (1, 3)):
        for (words, scale), (sw, ss) in zip((wg[:2], wg[2:]), (steps[:2], steps[2:])):
            words, scale, sw, ss = (t[lo:hi] for t in (words, scale, sw, ss))  # still contiguous
            a, b = _layout_strides(words, scale, "wgmma"), _layout_strides(sw, ss, "wgmma_steps")
            rows = torch.arange(words.shape[1])
            for kb in range(words.shape[2] // 32):
                assert torch.equal(kernel_read(words, a[:3], rows, kb), kernel_read(sw, b[:3], rows, kb)), (lo, kb)
                assert torch.equal(kernel_read(scale, a[3:], rows, kb), kernel_read(ss, b[3:], rows, kb)), (lo, kb)
    for words, scale, layout, row_words, row_scales in ((*steps[:2], "wgmma_steps", 32, 8),
                                                         (*wg[:2], "wgmma", wg[0].shape[2], wg[1].shape[2])):
        st = _layout_strides(words, scale, layout)
        assert (st[1], st[4] * 8) == (row_words, row_scales), layout  # from one row of a step to the next
    assert wg[0].shape[2] > 32


def test_layout_strides_refuse_what_the_kernels_cannot_read():
    w = make_experts(2, 256, 32, device="cpu", seed=13)
    words, scale = repack_int4_moe_for_wgmma_steps(*w)[:2]
    with pytest.raises(ValueError, match="one of"):
        _layout_strides(words, scale, "wgmma_rows")
    with pytest.raises(ValueError, match="contiguous"):
        _layout_strides(words[:, ::2], scale[:, ::2], "wgmma_steps")
    wg_words, wg_scale = repack_int4_moe_for_wgmma(*w)[:2]
    odd_rows = torch.zeros(*wg_scale.shape[:2], wg_scale.shape[2] + 1, dtype=wg_scale.dtype)[:, :, 1:]
    for words, scale in ((wg_words, odd_rows), (wg_words[:, :, ::2], wg_scale)):
        with pytest.raises(ValueError, match="16 bytes"):
            _layout_strides(words, scale, "wgmma")


def test_int4_moe_decodes_wgmma_steps_on_cpu():
    """`int4_moe(layout="wgmma_steps")` on CPU: the reference on the decoded weights == the "wgmma" layout's."""
    w = make_experts(4, 544, 96, device="cpu", seed=14)
    ids, tw = make_routing(5, 2, 4, device="cpu", seed=15)
    x = torch.randn(5, 544)
    a = int4_moe(x, ids, tw, *repack_int4_moe_for_wgmma(*w), layout="wgmma")
    b = int4_moe(x, ids, tw, *repack_int4_moe_for_wgmma_steps(*w), layout="wgmma_steps")
    assert torch.equal(a, b)


# --- GPU ----------------------------------------------------------------------------------------------------
run_steps = functools.partial(int4_moe_wgmma, layout="wgmma_steps")

# every kind of launch: decode (direct, PDL), fused decode, w2 with the combine, 64-row programs, two warpgroups,
# row tiles, the tiers; the plain one-block-size schedule
SCHEDULES = [{}, dict(fused=True), dict(fused=True, row_tiles=2, stages=3), dict(w2_combine=True),
             dict(rows=64), dict(rows=64, fused=True), dict(warpgroups=2), dict(row_tiles=2),
             dict(block_pairs=32, small_pairs=8, stages=2, maxnreg=168, row_tiles=4), dict(block_pairs=8, stages=2)]


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("T,k,E,D,inter", [(5, 3, 7, 544, 224), (1, 3, 7, 544, 224), (33, 4, 16, 1024, 160)])
@pytest.mark.parametrize("sched", SCHEDULES)
def test_int4_moe_wgmma_steps_vs_reference(T, k, E, D, inter, sched):
    check_layout_path(run_steps, repack_int4_moe_for_wgmma_steps, T, k, E, D, inter, **sched)


@pytest.fixture(scope="module")
def kimi_both(request):
    """All 384 Kimi K2.6 experts of one layer on the GPU in both orders (`kimi_wgmma`: skipped without sm_90)."""
    wg = request.getfixturevalue("kimi_wgmma")[1]
    return wg, (*to_step_major(*wg[:2]), *to_step_major(*wg[2:]))


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 9, 64])
def test_wgmma_steps_equals_wgmma_bitwise(kimi_both, T):
    """Kimi K2.6 shapes: the step-major layout gives the "wgmma" layout's bits for every schedule (crowded routing
    at 64 tokens, so the tiers' both paths run)."""
    wg, steps = kimi_both
    ids, tw = make_routing(T, KIMI["k"], KIMI["E"], device="cuda", seed=20 + T)
    if T == 64:
        ids[:24, :3] = ids[0, :3]
    x = torch.randn(T, KIMI["D"], device="cuda").to(torch.bfloat16)
    for sched in SCHEDULES:
        ref = run_poisoned(int4_moe_wgmma, x, ids, tw, wg, **sched)
        assert_bitwise(run_poisoned(run_steps, x, ids, tw, steps, **sched), ref, f"T={T} {sched}")
