"""bench/tile_read.py's read peer under the interpreter: both orders fold exactly each tile's words and scales."""

from __future__ import annotations

import os

import pytest
import torch

from bench import tile_read as tr

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs = pytest.mark.skipif(not (INTERP or torch.cuda.is_available()), reason="needs TRITON_INTERPRET=1 or a GPU")


def _case(E=5, N=32, KW=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() and not INTERP else "cpu"
    words = torch.randint(-2**31, 2**31 - 1, (E, N, KW), generator=g, dtype=torch.int32).to(dev)
    scales = torch.randint(-2**31, 2**31 - 1, (E, N, KW // 8), generator=g, dtype=torch.int32).to(dev)
    ids = torch.tensor([3, 0, 3, 4], dtype=torch.int32, device=dev)  # a repeated expert, not in order
    return words, scales, ids


@needs
@pytest.mark.parametrize("order", tr.ORDERS)
def test_each_tile_folds_its_own_bytes(order):
    words, scales, ids = _case()
    got = tr.tile_read(words, scales, ids, order, rows=16, unroll=2)
    want = tr.tile_read_ref(words, scales, ids, rows=16)
    assert got.shape == (4, 2) and torch.equal(got.cpu(), want.cpu())
    # one flipped bit of a scale of expert 4's second tile changes that tile's word only
    scales[4, 20, 3] ^= 1 << 7
    again = tr.tile_read(words, scales, ids, order, rows=16, unroll=2).cpu()
    changed = (again != got.cpu()).nonzero().tolist()
    assert changed == [[3, 1]]


def test_refuses_shapes_the_kernels_do_not_have():
    words, scales, ids = _case()
    with pytest.raises(ValueError, match="order"):
        tr.tile_read(words, scales, ids, "columns", rows=16)
    with pytest.raises(ValueError, match="unroll"):
        tr.tile_read(words, scales, ids, rows=16, unroll=4)  # 64 words: 2 steps
    with pytest.raises(ValueError, match="KS"):
        tr.tile_read(words, scales[:, :, :4].contiguous(), ids, rows=16, unroll=1)
    with pytest.raises(ValueError, match="multiple of 16"):
        tr.tile_read(words[:, :24].contiguous(), scales[:, :24].contiguous(), ids, rows=16, unroll=1)
