"""The tree build's ranking top-k (kernels/stable_topk.py): the Triton kernels against the reference, bit for bit.

CPU: under TRITON_INTERPRET=1, rows of awkward lengths (shorter than a segment, a partial last segment, several
segments), k from 1 to the row length, heavy ties (values clamped to one floor, repeated values across segment
boundaries, +0.0 and -0.0), and a [R, L, V] batch as the tree build passes it; values and indices must equal the
reference's exactly. GPU (marked `gpu`): K2.6 shapes (vocabulary 163840) through `top_k_stable`.
"""

from __future__ import annotations

import pytest
import torch

from kernels.stable_topk import top_k_stable, top_k_stable_ref, top_k_stable_triton


def _rows(R, n, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, n, generator=g)
    if ties:  # a floor shared by most values, a few repeated maxima, and signed zeros
        x = torch.where(x < 0.5, torch.tensor(-20.0), x.round())
        x[:, ::7] = 0.0
        x[:, 3::11] = -0.0
    return x


def _same(a, b):
    assert torch.equal(a[1], b[1]), (a[1], b[1])
    assert torch.equal(a[0].view(torch.int32), b[0].view(torch.int32))  # values bitwise (signed zeros too)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("R,n,k,seg", [(1, 5, 1, 16), (3, 37, 8, 16), (2, 100, 16, 32), (4, 64, 64, 16),
                                       (2, 300, 7, 64), (1, 17, 17, 16)])
def test_kernel_equals_reference(R, n, k, seg, ties):
    x = _rows(R, n, seed=n * 10 + k, ties=ties)
    _same(top_k_stable_triton(x, k, seg=seg), top_k_stable_ref(x, k))


def test_tree_build_batch_shape_and_launcher():
    x = _rows(6, 200, seed=3, ties=True).view(2, 3, 200).clamp(max=0.0)
    out = top_k_stable_triton(x, 8, seg=64)
    assert out[0].shape == out[1].shape == (2, 3, 8)
    _same(out, top_k_stable_ref(x, 8))
    _same(top_k_stable(x, 8), top_k_stable_ref(x, 8))  # off CUDA: the reference
    with pytest.raises(ValueError, match="1 <= k"):
        top_k_stable_triton(x, 201)
    with pytest.raises(ValueError, match="float32"):
        top_k_stable_triton(x.double(), 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows,k", [(7, 8), (224, 8), (14, 33)])
def test_kimi_vocabulary_on_the_gpu(rows, k):
    x = torch.log_softmax(torch.randn(rows, 163840, device="cuda") * 3, -1).clamp(min=-30.0)
    x[:, 1000:1010] = x[:, :1].max()  # ties at the top
    _same(top_k_stable(x, k), top_k_stable_ref(x, k))
