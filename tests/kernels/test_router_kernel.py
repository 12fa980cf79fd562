"""The router's selection (kernels/router.py): the Triton kernel against the torch reference.

CPU: the kernel under TRITON_INTERPRET=1 at awkward shapes (E not a power of 2, k not one, one row), outputs
poisoned, ties and NaN logits (k distinct experts in range, the lower id first); the launcher's dispatch (grouped
routing and CPU tensors take the reference). GPU (marked `gpu`): Kimi K2.6's 384 experts, top-8, against the
reference at 1..300 tokens, and a token alone equals itself inside a batch bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from kernels.router import route, route_ref, route_triton

CUDA = torch.cuda.is_available()


def logits_and_bias(T, E, seed, device="cpu"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = (torch.randn(T, E, generator=g) * 2).to(device)
    bias = (torch.randn(E, generator=g) * 0.1).to(device)
    return logits, bias


def check_against_reference(logits, bias, k, norm, scaling, got):
    ids, w = got
    want_ids, want_w = route_ref(logits, bias, k, norm_topk_prob=norm, scaling=scaling)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == want_ids.shape
    assert torch.equal(ids, want_ids)  # random logits: no two choices within the sigmoids' few ulps
    torch.testing.assert_close(w, want_w, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("T,E,k", [(1, 384, 8), (5, 7, 3), (3, 60, 1), (4, 385, 6), (2, 16, 16)])
@pytest.mark.parametrize("norm", [True, False])
def test_kernel_vs_reference(T, E, k, norm):
    logits, bias = logits_and_bias(T, E, seed=T * 100 + E + k)
    check_against_reference(logits, bias, k, norm, 2.827, route_triton(logits, bias, k, norm, 2.827))


def test_strided_logits_and_no_rows():
    logits, bias = logits_and_bias(6, 50, seed=3)
    wide = torch.cat((logits, torch.full((6, 14), float("nan"))), 1)[:, :50]  # rows at stride 64
    check_against_reference(logits, bias, 4, True, 1.0, route_triton(wide, bias, 4))
    ids, w = route_triton(torch.empty(0, 50), bias, 4)
    assert ids.shape == w.shape == (0, 4)


def test_ties_take_the_lower_id_and_nan_ranks_last():
    E, k = 20, 5
    bias = torch.zeros(E)
    ids, w = route_triton(torch.zeros(2, E), bias, k)  # every choice equal
    assert ids.tolist() == [list(range(k))] * 2
    torch.testing.assert_close(w, torch.full((2, k), 1 / k))
    logits = torch.linspace(-1, 1, E).repeat(2, 1)
    logits[0, [19, 3]] = float("nan")  # the largest one NaN
    logits[1] = float("nan")
    ids, _ = route_triton(logits, bias, k)
    assert ids[0].tolist() == [18, 17, 16, 15, 14]
    assert sorted(ids[1].tolist()) == list(range(k))  # all NaN: still k distinct experts in range


def test_launcher_dispatch():
    logits, bias = logits_and_bias(3, 64, seed=5)
    assert [torch.equal(a, b) for a, b in zip(route(logits, bias, 4), route_ref(logits, bias, 4))] == [True, True]
    grouped = route(logits, bias, 4, n_group=8, topk_group=2)  # CPU and grouped: the reference
    want = route_ref(logits, bias, 4, n_group=8, topk_group=2)
    assert torch.equal(grouped[0], want[0]) and torch.equal(grouped[1], want[1])
    kept = route_ref(logits, bias, 4, n_group=8, topk_group=2)[0]
    assert len({int(i) // 8 for i in kept[0]}) <= 2  # two groups kept
    with pytest.raises(ValueError, match="1 <= k <= E"):
        route_triton(logits, bias, 65)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_kimi_shapes_and_batch_invariance_gpu():
    logits, bias = logits_and_bias(300, 384, seed=7, device="cuda")
    ids, w = route(logits, bias, 8, scaling=2.827)
    check_against_reference(logits, bias, 8, True, 2.827, (ids, w))
    for r in (0, 37, 299):
        one = route(logits[r : r + 1], bias, 8, scaling=2.827)
        assert torch.equal(one[0][0], ids[r]) and torch.equal(one[1][0], w[r]), r
