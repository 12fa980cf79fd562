"""The drafter's block attention from its ring cache (kernels/draft_attention.py) against the reference.

CPU: the Triton kernel under TRITON_INTERPRET=1 in fp32 / fp16 at awkward shapes (query rows not a power of two,
block sizes 1-9, context lengths 0, 1, a partial tile, several tiles and the whole window, requests in scattered
cache rows with the other rows poisoned with NaN, strided cache views), outputs compared with the reference's
(gather, mask, SDPA); a row past ctx_len never leaks in. GPU (marked `gpu`): bf16 at K2.6 shapes (64 query heads
over 8 KV heads of 128, block 8, window 1024) through `draft_attention`, the launcher the drafter calls.
"""

from __future__ import annotations

import pytest
import torch

from kernels.draft_attention import draft_attention, draft_attention_ref, draft_attention_triton
from tests.kernels.compare import assert_close

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def _case(R, KV, M, hd, B, W, lengths, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    S = 2 * R + 3
    cache_k = torch.full((S, W, KV, hd), float("nan"))
    cache_v = torch.full((S, W, KV, hd), float("nan"))
    rows = torch.randperm(S, generator=g)[:R]
    for r, n in zip(rows.tolist(), lengths):  # valid ring rows hold data, the rest of every row stays NaN
        cache_k[r, :n] = torch.randn(n, KV, hd, generator=g)
        cache_v[r, :n] = torch.randn(n, KV, hd, generator=g)
    q = torch.randn(R, KV, M, hd, generator=g) * 2
    kb, vb = torch.randn(R, B, KV, hd, generator=g), torch.randn(R, B, KV, hd, generator=g)
    t = [x.to(dtype=dtype, device=device) for x in (q, cache_k, cache_v, kb, vb)]
    return t[0], t[1], t[2], rows.to(device), torch.tensor(lengths, dtype=torch.int64, device=device), t[3], t[4]


def _ref(q, ck, cv, rows, lens, kb, vb):
    """The reference on NaN-free inputs (SDPA's masked NaNs would poison it): the rows past ctx_len zeroed."""
    W = ck.shape[1]
    keep = (torch.arange(W, device=ck.device)[None, :] < lens[:, None])[:, :, None, None]
    ck2, cv2 = ck.clone(), cv.clone()
    ck2[rows] = torch.where(keep, ck[rows], 0).to(ck.dtype)
    cv2[rows] = torch.where(keep, cv[rows], 0).to(cv.dtype)
    return draft_attention_ref(q.float(), ck2.float(), cv2.float(), rows, lens, kb.float(), vb.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("R,KV,M,hd,B,W,lengths,block_n", [
    (3, 2, 16, 16, 8, 40, [0, 1, 40], 16),  # no context, one row, the whole window (2.5 tiles)
    (2, 1, 10, 32, 5, 64, [17, 63], 32),  # query rows not a power of two, a partial last tile
    (1, 3, 24, 16, 3, 100, [77], 64),
    (4, 2, 9, 16, 9, 32, [32, 5, 0, 31], 16),
    (2, 2, 1, 16, 1, 20, [3, 20], 16),  # one query row, a block of one
])
def test_kernel_vs_reference(R, KV, M, hd, B, W, lengths, block_n, dtype):
    q, ck, cv, rows, lens, kb, vb = _case(R, KV, M, hd, B, W, lengths, dtype, seed=R * 100 + W)
    out = draft_attention_triton(q, ck, cv, rows, lens, kb, vb, block_n=block_n)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out.float(), _ref(q, ck, cv, rows, lens, kb, vb), TOL[dtype], f"{R}x{KV}x{M}x{hd} B{B} W{W} {dtype}")


def test_strided_cache_view_and_zero_requests():
    """A layer's slice of the [layers, S, W, KV, hd] cache (the drafter passes cache.k[i]); R = 0 is empty."""
    q, ck, cv, rows, lens, kb, vb = _case(2, 2, 16, 16, 4, 24, [7, 24], torch.float32, seed=5)
    stack_k, stack_v = torch.stack((ck * 0, ck)), torch.stack((cv * 0, cv))
    out = draft_attention_triton(q, stack_k[1], stack_v[1], rows, lens, kb, vb, block_n=16)
    assert_close(out, _ref(q, ck, cv, rows, lens, kb, vb), TOL[torch.float32], "layer slice")
    empty = draft_attention_triton(q[:0], ck, cv, rows[:0], lens[:0], kb[:0], vb[:0])
    assert empty.shape == (0, 2, 16, 16)


def test_launcher_runs_the_reference_off_cuda_and_checks_shapes():
    q, ck, cv, rows, lens, kb, vb = _case(2, 2, 16, 16, 4, 24, [7, 24], torch.float32, seed=6)
    ck, cv = torch.nan_to_num(ck), torch.nan_to_num(cv)  # the reference's SDPA multiplies masked rows by 0
    args = (q, ck, cv, rows, lens, kb, vb)
    assert torch.equal(draft_attention(*args), draft_attention_ref(*args))
    with pytest.raises(ValueError, match="block keys"):
        draft_attention_triton(q, ck, cv, rows, lens, kb[:, :, :1], vb)
    with pytest.raises(ValueError, match="power of two"):
        draft_attention_triton(q[..., :12], ck[..., :12], cv[..., :12], rows, lens, kb[..., :12], vb[..., :12])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("R,lengths", [(1, [1000]), (5, [0, 1, 63, 64, 1024])])
def test_kimi_shapes_bf16_on_the_gpu(R, lengths):
    q, ck, cv, rows, lens, kb, vb = _case(R, 8, 64, 128, 8, 1024, lengths, torch.bfloat16, device="cuda", seed=R)
    with torch.no_grad():
        out = draft_attention(q, ck, cv, rows, lens, kb, vb)
    torch.cuda.synchronize()
    assert_close(out.float(), _ref(q, ck, cv, rows, lens, kb, vb), TOL[torch.bfloat16], f"K2.6 R{R}")
