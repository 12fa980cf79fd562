"""The seesaw MLA kernel's arithmetic (kernels/_mla_gluon_seesaw.py), checked on the CPU.

Gluon has no interpreter, so the kernel itself only runs on a GPU (test_mla_attention_gpu.py's gluon_seesaw cases). This
file replays its per-pair arithmetic in torch, step for step as the two consumers do it (base-2 scores, the row max
handed from consumer 0 to consumer 1, P rounded to the cache dtype, P0 published at m0 and O_R rescaled by s1
between consumer 1's two products, the row sums kept per consumer and added at the end), and checks the algebra
against a plain softmax: rows that see nothing, fully masked tiles (the phantom tile of an odd chunk), masked rows
inside tiles, very different score ranges between tiles (the max moving in either direction), and the (m, l, o)
partials folded as the combine kernel folds them. Keep it in step with the kernel (the barrier protocol:
test_mla_gluon_protocols.py).
"""

from __future__ import annotations

import pytest
import torch

NEG = float("-inf")


def seesaw_chunk(sc: torch.Tensor, v: torch.Tensor, dtype=torch.float32, skip_phantom: bool = True):
    """One (query tile, chunk): sc [M, K] base-2 scores (-inf = masked), v [K, D] -> (m, l, o) as the kernel keeps
    them: o [M, D] (O_L | O_R) and l at the running max m. skip_phantom: as the grid kernel (SKIP_PHANTOM), the
    phantom tile of an odd chunk gets no products (its S is all -inf, its P zero); off: products with a zero-filled
    phantom (the persistent kernel)."""
    M, K = sc.shape
    D = v.shape[1]
    half = D // 2
    n_pairs = -(-K // 128)
    pad = n_pairs * 128 - K
    sc = torch.cat([sc, torch.full((M, pad), NEG)], 1)  # the phantom tile / ragged end: masked, V zero-filled
    v = torch.cat([v, torch.zeros(pad, D)], 0)
    m = torch.full((M,), NEG)
    l0, l1 = torch.zeros(M), torch.zeros(M)
    o_l, o_r = torch.zeros(M, half), torch.zeros(M, half)
    for i in range(n_pairs):
        s0_, s1_ = sc[:, 128 * i:128 * i + 64], sc[:, 128 * i + 64:128 * i + 128]
        v0, v1 = v[128 * i:128 * i + 64], v[128 * i + 64:128 * i + 128]
        real1 = not skip_phantom or 128 * i + 64 < K  # tile 2i + 1 holds keys
        # consumer 0
        m0 = torch.maximum(m, s0_.amax(1))
        mu0 = torch.where(m0 == NEG, 0.0, m0)
        sc0 = torch.exp2(m - mu0)
        p0 = torch.exp2(s0_ - mu0[:, None])
        rs0 = p0.sum(1)
        o_l = o_l * sc0[:, None] + p0.to(dtype).float() @ v0[:, :half]
        # consumer 1 (after m0, s0)
        m1 = torch.maximum(m0, s1_.amax(1))
        mu1 = torch.where(m1 == NEG, 0.0, m1)
        sc1 = torch.exp2(m0 - mu1)
        p1 = torch.exp2(s1_ - mu1[:, None])
        rs1 = p1.sum(1)
        l1 = l1 * (sc0 * sc1) + rs1
        o_r = o_r * sc0[:, None] + p0.to(dtype).float() @ v0[:, half:]  # P0 V0R first, at m0 (P0 as published)
        o_r = o_r * sc1[:, None]  # then at m1
        if real1:
            o_r = o_r + p1.to(dtype).float() @ v1[:, half:]
        # consumer 0 (after m1, s1, P1)
        l0 = (l0 * sc0 + rs0) * sc1
        o_l = o_l * sc1[:, None]
        if real1:
            o_l = o_l + p1.to(dtype).float() @ v1[:, :half]
        m = m1
    return m, l0 + l1, torch.cat([o_l, o_r], 1)


def softmax_ref(sc, v):
    w = torch.exp2(sc - sc.amax(1, keepdim=True).nan_to_num(neginf=0.0))
    w = torch.where(torch.isnan(w), 0.0, w)
    l = w.sum(1, keepdim=True)
    return (w @ v) / torch.where(l == 0, 1.0, l)


def finish(m, l, o):
    return o / torch.where(l == 0, 1.0, l)[:, None]


def case(seed, K, masked_rows=(), masked_keys=slice(0, 0), spread=4.0):
    g = torch.Generator().manual_seed(seed)
    sc = torch.randn(64, K, generator=g) * spread
    # tiles on very different scales: the running max rises and falls between tiles
    for t0 in range(0, K, 64):
        sc[:, t0:t0 + 64] += float(torch.randint(-20, 20, (1,), generator=g))
    sc[list(masked_rows)] = NEG
    sc[:, masked_keys] = NEG
    v = torch.randn(K, 512, generator=g)
    return sc, v


@pytest.mark.parametrize("K", [1, 63, 64, 65, 128, 129, 300, 512, 2048 + 5])
def test_seesaw_pairs_equal_softmax(K):
    sc, v = case(K, K, masked_rows=(3, 40), masked_keys=slice(K // 3, K // 3 + 70))
    m, l, o = seesaw_chunk(sc, v)
    torch.testing.assert_close(finish(m, l, o), softmax_ref(sc, v), rtol=1e-5, atol=1e-5)
    assert torch.equal(o[3], torch.zeros(512)) and l[3] == 0 and m[3] == NEG  # a row that sees nothing


@pytest.mark.parametrize("K", [1, 63, 64, 65, 129, 300, 2048 + 5])
def test_skipping_the_phantoms_products_keeps_every_value(K):
    """The grid kernel computes neither S of an odd chunk's phantom tile nor its products (`_ss_consumer`,
    SKIP_PHANTOM); the persistent kernel computes them with a zero-filled tile. Both give the same m, l and O, bit for
    bit, here with a masked row that sees nothing, a masked run of keys and tiles on very different scales (an odd
    tile count ends with a phantom: K = 1, 63, 64, 129, 300 and 2053 keys; K = 65 is two tiles and has none)."""
    sc, v = case(K + 7, K, masked_rows=(5,), masked_keys=slice(K // 2, K // 2 + 20))
    for dtype in (torch.float32, torch.bfloat16):
        skipped = seesaw_chunk(sc, v, dtype)
        computed = seesaw_chunk(sc, v, dtype, skip_phantom=False)
        for a, b in zip(skipped, computed):
            assert torch.equal(a, b)


def test_seesaw_with_p_in_bf16_stays_within_bf16_error():
    sc, v = case(7, 1000)
    out = finish(*seesaw_chunk(sc, v, torch.bfloat16))
    ref = softmax_ref(sc, v)
    assert ((out - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("K,cut", [(2048, 1024), (700, 128), (129, 64)])
def test_seesaw_partials_fold_like_the_combine(K, cut):
    """Two chunks' (m, l, o) folded in chunk order (as `_mla_combine_kernel`: weights 2^(m_c - M)) equal the softmax
    over both."""
    sc, v = case(K + 1, K, masked_keys=slice(cut - 10, cut + 10))
    parts = [seesaw_chunk(sc[:, a:b], v[a:b]) for a, b in ((0, cut), (cut, K))]
    mm = torch.stack([p[0] for p in parts])
    M = mm.amax(0)
    Mu = torch.where(M == NEG, 0.0, M)
    w = torch.exp2(mm - Mu)
    l = sum(wc * p[1] for wc, p in zip(w, parts))
    o = sum(wc[:, None] * p[2] for wc, p in zip(w, parts))
    torch.testing.assert_close(finish(M, l, o), softmax_ref(sc, v), rtol=1e-5, atol=1e-5)
