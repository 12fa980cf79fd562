"""kernels/_moe_frame.py, the launches around the Gluon paths' GEMMs, on CPU: with torch GEMMs that follow the
contract the Gluon kernels implement (blocks of `sorted_pairs` per `block_expert`, padding slots skipped; or, direct,
one block per pair with its expert id), the frame reproduces the reference MoE, also for K not a multiple of the
layout's step and for a subset of the experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels._moe_frame import routed_moe
from kernels.int4_moe import moe_dense_ref


def _gemms(w13d, w2d, block_pairs, direct=False):
    """Torch stand-ins for the kernels: dense weights [E, 2I, Kp13] / [E, D, Kp2] (zero-padded K)."""
    inter = w13d.shape[1] // 2

    def blocks(pairs, bexp, P):
        for b, e in enumerate(bexp.tolist()):
            if direct:  # block b is pair b; `pairs` is not to be read
                yield e, torch.tensor([b])
            elif e >= 0:
                ids = pairs[b * block_pairs:(b + 1) * block_pairs]
                yield e, ids[ids < P].long()

    def w13_gemm(x, a, pairs, bexp, topk, P):
        for e, ids in blocks(pairs, bexp, P):
            h = x[ids // topk].double() @ w13d[e].T
            a[ids, :inter] = (F.silu(h[:, :inter]) * h[:, inter:]).to(a.dtype)

    def w2_gemm(a, y, pairs, bexp, topk, P):
        for e, ids in blocks(pairs, bexp, P):
            y[ids] = (a[ids].double() @ w2d[e].T).float()

    return w13_gemm, w2_gemm


@pytest.mark.parametrize("held,T,direct", [(None, 6, False), (range(2, 5), 6, False), (None, 1, True)])
def test_routed_moe_frame_matches_the_reference(held, T, direct):
    k, E, D, inter, align, bp = 3, 7, 40, 24, 64, 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    tw = torch.rand(T, k, generator=g, dtype=torch.float64)
    n = E if held is None else len(held)
    w13 = torch.randn(n, 2 * inter, D, generator=g, dtype=torch.float64) / D**0.5
    w2 = torch.randn(n, D, inter, generator=g, dtype=torch.float64) / inter**0.5
    kp13, kp2 = -(-D // align) * align, -(-inter // align) * align
    w13p, w2p = F.pad(w13, (0, kp13 - D)), F.pad(w2, (0, kp2 - inter))
    words13 = torch.zeros(n, 2 * inter, kp13 // 8, dtype=torch.int32)  # only the shapes matter to the frame
    words2 = torch.zeros(n, D, kp2 // 8, dtype=torch.int32)
    g13, g2 = _gemms(w13p, w2p, bp, direct)
    out = routed_moe("test", x, ids, tw.float(), words13, None, words2, None, torch.full_like(x, float("nan")),
                     k_align=align, block_pairs=bp, experts=held, reduce_pairs=None, w13_gemm=g13, w2_gemm=g2,
                     direct=direct)
    ref = moe_dense_ref(x, ids, tw, w13, w2, held, None)
    torch.testing.assert_close(out, ref.to(out.dtype), rtol=1e-5, atol=1e-6)


def test_routed_moe_frame_refuses_weights_of_another_shape():
    x = torch.randn(2, 40)
    bad = torch.zeros(3, 48, 40 // 8, dtype=torch.int32)  # K = 40 is not padded to the layout's 64
    with pytest.raises(ValueError, match="test: x"):
        routed_moe("test", x, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), bad, None, bad, None, None,
                   k_align=64, block_pairs=8, experts=None, reduce_pairs=None, w13_gemm=None, w2_gemm=None)


def test_direct_blocks_need_one_token_and_every_expert():
    x = torch.randn(2, 64)
    w = torch.zeros(3, 48, 8, dtype=torch.int32)
    w2 = torch.zeros(3, 64, 8, dtype=torch.int32)  # I = 24, K padded to 64
    for xx, held in ((x, None), (x[:1], range(0, 3))):
        with pytest.raises(ValueError, match="direct blocks"):
            routed_moe("test", xx, torch.zeros(xx.shape[0], 2, dtype=torch.long), torch.ones(xx.shape[0], 2), w, None,
                       w2, None, None, k_align=64, block_pairs=8, experts=held, reduce_pairs=None, w13_gemm=None,
                       w2_gemm=None, direct=True)


def test_a_w2_that_combines_is_not_followed_by_the_combine(monkeypatch):
    """`combined`: the w2 launch also wrote each token's combine into `out` (int4_moe_wgmma's w2_combine), so the frame
    launches no combine kernel after it and returns `out` as w2 left it: one token with direct blocks reproduces the
    reference; a combine over several tokens or before an expert-parallel reduction is refused before any launch."""
    import kernels._moe_frame as frame

    k, E, D, inter, align = 3, 7, 40, 24, 64
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, D, generator=g, dtype=torch.float64)
    ids = torch.randperm(E, generator=g)[:k].view(1, k)
    tw = torch.rand(1, k, generator=g, dtype=torch.float64)
    w13 = torch.randn(E, 2 * inter, D, generator=g, dtype=torch.float64) / D**0.5
    w2 = torch.randn(E, D, inter, generator=g, dtype=torch.float64) / inter**0.5
    w13p, w2p = F.pad(w13, (0, align - D)), F.pad(w2, (0, align - inter))
    words13 = torch.zeros(E, 2 * inter, align // 8, dtype=torch.int32)
    words2 = torch.zeros(E, D, align // 8, dtype=torch.int32)
    g13, g2 = _gemms(w13p, w2p, 8, direct=True)
    out = torch.full_like(x, float("nan"))

    def w2_and_combine(a, y, pairs, bexp, topk, P):
        g2(a, y, pairs, bexp, topk, P)
        out[0] = (tw[0].view(k, 1) * y[:k].double()).sum(0).to(out.dtype)

    def no_combine(*args, **kwargs):
        raise AssertionError("a combine launch after a w2 that combined")

    # a launch (the kernel indexed with its grid, then called) fails the test
    monkeypatch.setattr(frame, "_moe_combine_kernel", type("NoLaunch", (), {"__getitem__": lambda s, g: no_combine})())
    got = routed_moe("test", x, ids, tw.float(), words13, None, words2, None, out, k_align=align, block_pairs=8,
                     experts=None, reduce_pairs=None, w13_gemm=g13, w2_gemm=w2_and_combine, direct=True, combined=True)
    assert got is out
    torch.testing.assert_close(out, moe_dense_ref(x, ids, tw, w13, w2, None, None).to(out.dtype), rtol=1e-5,
                               atol=1e-6)
    x2 = torch.randn(2, D, dtype=torch.float64)
    for xx, reduce in ((x2, None), (x, lambda rows: None)):
        with pytest.raises(ValueError, match="combine in w2"):
            routed_moe("test", xx, ids.expand(xx.shape[0], k), tw.float().expand(xx.shape[0], k), words13, None,
                       words2, None, None, k_align=align, block_pairs=8, experts=None, reduce_pairs=reduce,
                       w13_gemm=no_combine, w2_gemm=no_combine, combined=True)
