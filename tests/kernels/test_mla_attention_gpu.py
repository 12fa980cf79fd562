"""Absorbed MLA attention kernel (kernels/mla_attention.py) on the GPU at Kimi K2.6 shapes: 64 heads, 512 + 64, bf16,
prefixes up to 33k, for every tile kernel (`impl` "triton" and the sm_90 Gluon kernels "gluon", "gluon_ws" and
"gluon_seesaw"): within tolerance of the reference; TMA loads bitwise the cp.async ones; the persistent forms of
"gluon" and "gluon_seesaw" bitwise their grids, the seesaw kernel's value columns split over programs bitwise one
program and its skip of an odd chunk's phantom tile bitwise the product with it; partials in fp32 and bf16; the fold
(Triton and gluon) bitwise the split launch; batch invariance (a session alone vs inside a batch of 64: bitwise equal)
and position alignment (a tree node == the AR step at its position, bitwise) in bf16. The CPU side of the same checks:
test_mla_attention.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels.mla_attention import mla_attention_triton
from tests.kernels.compare import assert_close
from tests.kernels.mla_cases import (
    CUDA,
    DEV,
    TOL,
    assert_bitwise,
    check_alignment,
    make_batch,
    reference,
    rows_by_chunks,
    run_kernel,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]


def assert_graph_replay(args, want: torch.Tensor, **kw) -> None:
    """The launch, compiled outside the capture, captured in a CUDA graph and replayed: `want`, bit for bit."""
    out = torch.full_like(want, float("nan"))
    mla_attention_triton(*args, SCALE, out=out, **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla_attention_triton(*args, SCALE, out=out, **kw)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert_bitwise(out, want, f"graph replay {kw}")


KIMI = dict(H=64, Dl=512, Dr=64, page=64)
IMPLS_GPU = ["triton", "gluon", "gluon_ws", "gluon_seesaw"]
SCALE = 192**-0.5 * (0.1 * torch.log(torch.tensor(64.0)).item() + 1) ** 2


@pytest.mark.parametrize("impl", IMPLS_GPU)
@pytest.mark.parametrize("prefix,ns,tree,page", [
    ([1024, 0, 4097, 33000], [9, 65, 1, 33], True, 64),
    ([0, 300], [257, 64], False, 64),
    ([70, 2047, 5000], [2, 65, 17], True, 16),  # the serving page size: a 64-key tile spans 4 pages
    ([13, 1500], [90, 31], False, 16),
])
def test_mla_kimi_shapes_bf16(prefix, ns, tree, page, impl):
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], page, torch.bfloat16, tree)
    assert_close(run_kernel(args, SCALE, impl=impl), reference(args, SCALE), TOL[torch.bfloat16],
                 f"Kimi {prefix} {ns} {impl}")


@pytest.mark.parametrize("page", [16, 32, 64, 128])
@pytest.mark.parametrize("tree,prefix,ns", [
    # prefixes on, just below and just past tile and page edges; a tree whose first ancestor tile is ragged; 16
    # chunks past 8192 keys; prefix 0 (no whole committed tile: every tile by cp.async)
    (True, [0, 63, 64, 65, 1000, 4097, 33000], [9, 65, 1, 33, 17, 5, 40]),
    (False, [0, 127, 2048, 9001], [70, 3, 64, 1]),
])
def test_mla_gluon_tma_loads_give_the_cp_async_bits(tree, prefix, ns, page):
    """The Gluon kernel with whole committed tiles loaded by TMA (pages of 16 and 32 rows: a tile is 4 or 2 boxes,
    one per page; 64 and 128: a tile is a page or half of one) equals, bit for bit, the same kernel gathering every
    tile with cp.async, and the reference within tolerance; the pool is a layer of a stacked cache (an offset
    view), unused slots NaN."""
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], page, torch.bfloat16, tree, seed=7)
    q, qpe, kv, *rest = args
    stack = torch.full((3, *kv.shape), float("nan"), dtype=kv.dtype, device=kv.device)
    stack[1] = kv
    layer = (q, qpe, stack[1], *rest)
    with_tma = run_kernel(layer, SCALE, impl="gluon", tma=True)
    assert_bitwise(with_tma, run_kernel(layer, SCALE, impl="gluon", tma=False), f"tma page {page} tree={tree}")
    assert_close(with_tma, reference(args, SCALE), TOL[torch.bfloat16], f"tma page {page} {prefix} {ns}")
    # queries as views: rows of 1024 (the query tile still by TMA), every other token of a larger batch (a token's
    # heads are not rows of one 2D view: plain loads)
    T, H = q.shape[:2]
    wide = torch.full((T, H, 1024), float("nan"), dtype=q.dtype, device=q.device)
    wide[..., :KIMI["Dl"]] = q
    spread = torch.full((2 * T, H, KIMI["Dr"]), float("nan"), dtype=q.dtype, device=q.device)
    spread[::2] = qpe
    views = (wide[..., :KIMI["Dl"]], spread[::2], stack[1], *rest)
    assert_bitwise(run_kernel(views, SCALE, impl="gluon", tma=True), with_tma, f"query views, page {page}")


@pytest.mark.parametrize("impl", ["gluon", "gluon_seesaw"])
@pytest.mark.parametrize("programs", [None, 1, 5])
@pytest.mark.parametrize("page", [8, 16, 64])
@pytest.mark.parametrize("tree,prefix,ns,table_len", [
    # one-tile items next to 16-chunk rows, a session without queries, a row with nothing committed
    (True, [0, 63, 64, 65, 1000, 0, 4097, 9001], [9, 65, 1, 33, 17, 0, 5, 40], 0),
    (False, [0, 127, 2048, 5], [70, 3, 64, 1], 0),
    (True, [0], [1], 0),  # one item in all
    # a serving pool's wide table (16 chunk slots) under rows of at most 6 chunks: the persistent seesaw walks
    # only the slots below the longest row's count (`_ssp_total`)
    (True, [1000, 64, 3000, 2900], [9, 65, 33, 0], 16384),
])
def test_mla_gluon_persistent_gives_the_grid_kernels_bits(tree, prefix, ns, table_len, page, programs, impl,
                                                          monkeypatch):
    """The persistent kernels (`_mla_gluon_persistent`, `_mla_gluon_seesaw_persistent`: one program per SM walking
    its items; here also 1 and 5 programs, so a program runs hundreds of items and crosses every kind of item
    boundary) equal, bit for bit, their grid kernels (one program per item) with the same loads, and the reference
    within tolerance. Page 8: every tile by cp.async (only the query tiles by TMA); 16 / 64: the TMA tiles too."""
    import kernels.mla_attention as mla

    if programs is not None:
        monkeypatch.setattr(mla, "_sm_count", lambda index: programs)
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], page, torch.bfloat16, tree, seed=11,
                      table_len=table_len)
    out = run_kernel(args, SCALE, impl=impl, persistent=True)
    assert_bitwise(out, run_kernel(args, SCALE, impl=impl, persistent=False), f"{impl} page {page} tree={tree}")
    assert_close(out, reference(args, SCALE), TOL[torch.bfloat16], f"persistent {impl} page {page} {prefix} {ns}")
    # launched twice in a row (the stream leaves no state behind) and from a CUDA graph
    assert_bitwise(run_kernel(args, SCALE, impl=impl, persistent=True), out, "second launch")
    assert_graph_replay(args, out, impl=impl, persistent=True)


@pytest.mark.parametrize("page,partials,vsplit", [  # (each VSPLIT, TREE, page and partial dtype compiles anew)
    (16, "out", 2), (16, "out", 4), (16, "out", "auto"), (8, "out", 4), (16, "fp32", 4)])
@pytest.mark.parametrize("tree,prefix,ns", [
    # one-chunk rows (the output written directly), 2-16 chunks (partials), an odd chunk's phantom tile, a session
    # without queries, a row with nothing committed
    (True, [0, 63, 1000, 0, 4097, 9001], [9, 1, 17, 0, 5, 3]),
    (False, [0, 127, 2048, 5], [70, 3, 64, 1]),
    (True, [1000], [9]),  # a small launch: 9 tiles x 2 chunks
])
def test_mla_seesaw_value_split_gives_the_same_bits(tree, prefix, ns, page, partials, vsplit):
    """The seesaw grid kernel with each (query tile, chunk)'s 512 value columns split over 2 or 4 programs
    (`vsplit`) equals, bit for bit, one program per item: S, the softmax and the row sums are computed whole in every
    part, so this checks that a warpgroup MMA's sum over the keys is the same at N = 64 or 128 as at 256, and the
    view of a stage as blocks of columns (`_mla_gluon_seesaw._ss_values`). Page 8: tiles by cp.async; 16: by TMA."""
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], page, torch.bfloat16, tree, seed=13)
    kw = dict(impl="gluon_seesaw", persistent=False, partials=partials)
    out = run_kernel(args, SCALE, vsplit=vsplit, **kw)
    assert_bitwise(out, run_kernel(args, SCALE, vsplit=1, **kw), f"vsplit {vsplit} page {page} tree={tree}")
    assert_close(out, reference(args, SCALE), TOL[torch.bfloat16], f"vsplit {vsplit} page {page} {prefix} {ns}")
    assert_graph_replay(args, out, vsplit=vsplit, **kw)


@pytest.mark.parametrize("page,partials,vsplit", [(16, "out", 1), (64, "out", 1), (8, "out", 1), (16, "fp32", 1),
                                                   (16, "out", 2)])
@pytest.mark.parametrize("tree,prefix,ns", [
    # chunks of odd tile counts (a phantom: rows of 1 and 3 tiles, 4097 + a few keys = 8 x 8 + 9 tiles, 9001 + a few
    # = 16 chunks of 8 and 9) and even ones (1000 + up to 17 keys = 2 x 8 tiles), a session without queries, a row
    # with nothing committed
    (True, [0, 63, 1000, 0, 4097, 9001], [9, 1, 17, 0, 5, 3]),
    (False, [0, 127, 2048, 5], [70, 3, 64, 1]),
])
def test_mla_seesaw_phantom_skip_gives_the_same_bits(tree, prefix, ns, page, partials, vsplit):
    """The seesaw grid kernel skipping an odd chunk's phantom tile (`skip_phantom`: no load, no S, no products)
    equals, bit for bit, the kernel that loads it zero-filled and multiplies (the products add exact zeros, the
    rescale factor is 2^0). Page 8: tiles by cp.async; 16 and 64: by TMA; bf16 and fp32 partials; values split."""
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], page, torch.bfloat16, tree, seed=19)
    kw = dict(impl="gluon_seesaw", persistent=False, partials=partials, vsplit=vsplit)
    out = run_kernel(args, SCALE, skip_phantom=True, **kw)
    assert_bitwise(out, run_kernel(args, SCALE, skip_phantom=False, **kw), f"skip page {page} tree={tree}")
    assert_close(out, reference(args, SCALE), TOL[torch.bfloat16], f"skip page {page} {prefix} {ns}")
    assert_graph_replay(args, out, skip_phantom=True, **kw)


@pytest.mark.parametrize("page", [16, 64])
def test_mla_default_kernel_is_the_seesaw_and_replays_from_a_graph(page):
    """impl=None (the module default, "auto") runs the seesaw kernel on sm_90: its bits, a second launch's bits, and
    the same from a CUDA graph (as the engine's verify step replays it), tree and causal, 1 to 16 chunks a row."""
    import kernels.mla_attention as mla

    assert mla.resolved_impl(mla.DEFAULT_IMPL, "cuda", KIMI["H"], KIMI["Dl"], KIMI["Dr"], torch.bfloat16) == \
        "gluon_seesaw"
    for tree, prefix, ns in ((True, [5, 700, 4097, 33000], [9, 65, 17, 5]), (False, [0, 300, 9001], [257, 64, 3])):
        args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], page, torch.bfloat16, tree, seed=17)
        out = run_kernel(args, SCALE)
        assert_bitwise(out, run_kernel(args, SCALE, impl="gluon_seesaw"), f"default vs seesaw tree={tree}")
        assert_bitwise(run_kernel(args, SCALE), out, "second launch")
        assert_graph_replay(args, out)
        assert_close(out, reference(args, SCALE), TOL[torch.bfloat16], f"default page {page} tree={tree}")


@pytest.mark.parametrize("impl", IMPLS_GPU)
def test_mla_fp16_and_two_head_tiles(impl):
    """fp16 cache and 128 heads (two 64-head tiles per token), tree and causal, against the reference."""
    for tree, prefix, ns in ((True, [700, 9000], [33, 9]), (False, [5, 1200], [40, 3])):
        args = make_batch(prefix, ns, 128, KIMI["Dl"], KIMI["Dr"], 16, torch.float16, tree, seed=3)
        assert_close(run_kernel(args, SCALE, impl=impl), reference(args, SCALE), TOL[torch.float16],
                     f"fp16 128 heads tree={tree} {impl}")


@pytest.mark.parametrize("impl", IMPLS_GPU)
@pytest.mark.parametrize("tree", [True, False])
def test_mla_bf16_partials(tree, impl):
    """partials="out" (bf16 partial O) at Kimi shapes: one-chunk rows keep the fp32-partials bits, the others stay
    within bf16 tolerance of the reference and within 2x the fp32 partials' error (batch invariance and alignment
    with it: the tests below)."""
    prefix, ns = ([5, 700, 4097, 33000], [9, 65, 17, 5]) if tree else ([0, 300, 9001], [257, 64, 3])
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], 16, torch.bfloat16, tree, seed=9)
    want = reference(args, SCALE)
    fp32 = run_kernel(args, SCALE, impl=impl, partials="fp32")
    half = run_kernel(args, SCALE, impl=impl, partials="out")
    many = rows_by_chunks(prefix, ns, None if args[7] is None else args[7].cpu()).to(DEV)
    assert bool(many.any()) and not bool(many.all())
    assert_bitwise(half[~many], fp32[~many], f"one-chunk rows, {impl}")
    assert_close(half, want, TOL[torch.bfloat16], f"bf16 partials {impl} tree={tree}")
    err = lambda out: float((out.double() - want.double()).norm() / want.double().norm())  # noqa: E731
    assert err(half) <= 2.0 * err(fp32), (err(half), err(fp32))


@pytest.mark.parametrize("partials", ["fp32", "out"])
@pytest.mark.parametrize("tree", [True, False])
@pytest.mark.parametrize("impl,page", [("triton", 16), ("gluon", 16), ("gluon", 64), ("gluon", 8)])
def test_mla_fold_gives_the_split_bits_bf16(tree, partials, impl, page):
    """fold=True at Kimi shapes in bf16: bitwise the split launch with its combine kernel (the same exp2 / fma on
    the GPU), 1 to 16 chunks a row (the gluon kernel's stage barriers made anew for each chunk; page 8: every tile
    by cp.async), within tolerance of the reference; a second launch and a CUDA-graph replay give the same."""
    prefix, ns = ([5, 700, 4097, 33000], [9, 65, 17, 5]) if tree else ([0, 300, 9001], [257, 64, 3])
    args = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], page, torch.bfloat16, tree, seed=13)
    folded = run_kernel(args, SCALE, impl=impl, fold=True, partials=partials)
    assert_bitwise(folded, run_kernel(args, SCALE, impl=impl, fold=False, partials=partials), f"tree={tree}")
    assert_close(folded, reference(args, SCALE), TOL[torch.bfloat16], f"fold tree={tree} {partials}")
    assert_bitwise(run_kernel(args, SCALE, impl=impl, fold=True, partials=partials), folded, "second launch")
    assert_bitwise(run_kernel(args, SCALE, impl=impl, fold="auto", partials=partials), folded, "auto")
    assert_graph_replay(args, folded, impl=impl, fold=True, partials=partials)


@pytest.mark.parametrize("impl", IMPLS_GPU)
@pytest.mark.parametrize("partials", ["fp32", "out"])
@pytest.mark.parametrize("n_probe", [1, 9, 65])
def test_mla_batch_invariance(n_probe, partials, impl):
    """A session alone and as session 23 of 64 others (mixed lengths): bitwise equal rows (partials in fp32 and
    in bf16)."""
    g = torch.Generator().manual_seed(n_probe)
    prefix = torch.randint(0, 3000, (64,), generator=g).tolist()
    ns = torch.randint(1, 66, (64,), generator=g).tolist()
    prefix[23], ns[23] = 2900, n_probe  # 6 KV chunks
    big = make_batch(prefix, ns, KIMI["H"], KIMI["Dl"], KIMI["Dr"], KIMI["page"], torch.bfloat16, True)
    q, qpe, kv, bt, page, cu, pre, bits = big
    t0, t1 = int(cu[23]), int(cu[24])
    alone = (q[t0:t1], qpe[t0:t1], kv, bt[23:24], page, torch.tensor([0, t1 - t0], dtype=torch.int32, device=DEV),
             pre[23:24], bits[t0:t1])
    out_big = run_kernel(big, SCALE, impl=impl, partials=partials)
    out_alone = run_kernel(alone, SCALE, impl=impl, partials=partials)
    assert torch.equal(out_alone, out_big[t0:t1])
    # the tree's root alone (= the AR step at the same prefix) gives the root row bit for bit
    root = (q[t0:t0 + 1], qpe[t0:t0 + 1], kv, bt[23:24], page, torch.tensor([0, 1], dtype=torch.int32, device=DEV),
            pre[23:24], bits[t0:t0 + 1])
    assert torch.equal(run_kernel(root, SCALE, impl=impl, partials=partials)[0], out_big[t0])


@pytest.mark.parametrize("prefix,ns,checked,words", [
    # 5 -> 6 chunks at p = 2815 inside session 0's tree; session 1: the 16th chunk gains a tile at p = 8192
    ([2810, 8185, 700], [65, 17, 9], [0, 1], 2),
    # one bit word (budgets <= 63); session 0 crosses p = 8192; session 1: 16 chunks of 64-65 tiles; prefix 0
    ([8180, 33000, 0], [40, 9, 20], [0, 1, 2], 1),
])
@pytest.mark.parametrize("impl,partials",
                         [(impl, "fp32") for impl in IMPLS_GPU] + [("gluon", "out"), ("gluon_seesaw", "out")])
def test_mla_tree_node_equals_ar_step_bitwise_bf16(prefix, ns, checked, words, impl, partials):
    """The position-alignment invariant at Kimi shapes in bf16: every node of the checked sessions
    equals the causal decode / AR step / prefill row at its position in the AR layout, bitwise."""
    check_alignment(prefix, ns, checked, KIMI["H"], KIMI["Dl"], KIMI["Dr"], KIMI["page"], torch.bfloat16, words,
                    SCALE, impl=impl, partials=partials)
