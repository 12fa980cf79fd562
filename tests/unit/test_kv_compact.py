"""compact_kv (in-place overlapping row moves) and path_moves (accepted path -> moves)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.kv_compact import compact_kv, path_moves
from kernels.tree_accept import accept_greedy
from kernels.tree_build import build_tree
from verifier_service.kv_cache import KVCapacityError, KVPool


def expected_after(cache: torch.Tensor, src, dst) -> torch.Tensor:
    """Clone-based expectation: every destination reads the *original* source row."""
    old, out = cache.clone(), cache.clone()
    for s, d in zip(torch.as_tensor(src).reshape(-1).tolist(), torch.as_tensor(dst).reshape(-1).tolist()):
        out[..., d, :] = old[..., s, :]
    return out


def test_overlapping_moves_with_layer_dim():
    cache = torch.randn(3, 20, 5)
    # slot 5 and slot 2 are both read and written; 9 -> 5 after 5 -> 2 must move the old row 5
    src = torch.tensor([5, 7, 2, 9, 11])
    dst = torch.tensor([2, 3, 4, 5, 11])  # 11 -> 11 is a no-op
    want = expected_after(cache, src, dst)
    compact_kv(cache, src, dst)
    assert torch.equal(cache, want)


def test_chain_shift_down_is_not_sequential():
    # moving rows 1..6 down by one in one call: a naive in-order copy would smear row 1
    cache = torch.arange(8.0)[None, :, None].expand(2, 8, 3).clone()
    compact_kv(cache, torch.arange(1, 7), torch.arange(0, 6))
    assert cache[0, :, 0].tolist() == [1, 2, 3, 4, 5, 6, 6, 7]
    # and up by one (destinations ahead of sources)
    cache = torch.arange(8.0)[None, :, None].expand(2, 8, 3).clone()
    compact_kv(cache, torch.arange(0, 6), torch.arange(1, 7))
    assert cache[1, :, 2].tolist() == [0, 0, 1, 2, 3, 4, 5, 7]


@pytest.mark.parametrize("seed", range(5))
def test_random_moves_on_paged_view(seed):
    rng = random.Random(seed)
    layers, pages, page_size, C = 2, 6, 4, 7
    pool = torch.randn(layers, pages, page_size, C, dtype=torch.bfloat16)
    flat = pool.view(layers, pages * page_size, C)  # the caller's flat slot view of a paged pool
    S = pages * page_size
    P = rng.randint(1, S)
    dst = torch.tensor(rng.sample(range(S), P))  # destinations must be unique
    src = torch.tensor([rng.randrange(S) for _ in range(P)])  # sources may repeat
    want = expected_after(flat, src, dst)
    compact_kv(flat, src.view(1, P), dst.view(1, P))  # any (equal) index shape
    assert torch.equal(flat, want)
    assert torch.equal(pool.view(layers, S, C), want)  # written through to the pool


def test_rejects_shape_mismatch():
    with pytest.raises(ValueError):
        compact_kv(torch.zeros(4, 2), torch.tensor([0, 1]), torch.tensor([1]))


def test_path_moves_hand_built():
    path = torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1], [0, 1, 3, 6]], dtype=torch.int32)
    acc = torch.tensor([2, 0, 3], dtype=torch.int32)
    src, dst = path_moves(path, acc)
    assert src.tolist() == [[0, 2, 5, 3], [0, 1, 2, 3], [0, 1, 3, 6]]
    assert dst.tolist() == [[0, 1, 2, 3]] * 3
    src, dst = path_moves(path, acc, base_index=torch.tensor([10, 30, 50]))
    assert src.tolist() == [[10, 12, 15, 13], [30, 31, 32, 33], [50, 51, 53, 56]]
    assert dst.tolist() == [[10, 11, 12, 13], [30, 31, 32, 33], [50, 51, 52, 53]]
    assert src.dtype == dst.dtype == torch.int64


def test_build_accept_compact_end_to_end():
    """Rows tagged with their node index end up in path order right after the prefix."""
    gen = torch.Generator().manual_seed(0)
    R, L, V = 3, 5, 9
    lq = torch.log_softmax(torch.randn(R, L, V, generator=gen), -1)
    tree = build_tree(lq, torch.tensor([1, 2, 3]), [20, 7, 40], [3, 2, 4])
    M = tree.tokens.shape[1]
    # posterior = the first child's token everywhere: accepts the first-child chain
    fc = tree.first_child.long()
    post = torch.where(fc >= 0, tree.tokens.long().gather(1, fc.clamp(min=0)), 0)
    res = accept_greedy(tree.tokens, tree.parent, tree.n_nodes_device(), post, L)
    base = torch.tensor([4, 0, 11])  # committed lengths; session r owns slots [100 r, 100 r + 100)
    src, dst = path_moves(res.path, res.accept_len, base)
    offs = torch.arange(R)[:, None] * 100
    cache = torch.zeros(2, 100 * R, 1)
    for r in range(R):
        b = 100 * r + base[r].item()
        cache[:, b : b + M, 0] = torch.arange(M, dtype=torch.float32)  # node k at L_r + k
    compact_kv(cache, src + offs, dst + offs)
    for r in range(R):
        n = res.accept_len[r].item()
        b = 100 * r + base[r].item()
        assert cache[0, b : b + n + 1, 0].long().tolist() == res.path[r, : n + 1].tolist()
        assert n > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_no_host_sync_and_matches_cpu():
    cache = torch.randn(3, 40, 8)
    path = torch.tensor([[0, 3, 7, -1], [0, 1, 2, 9]], dtype=torch.int32)
    acc = torch.tensor([2, 3], dtype=torch.int32)
    base = torch.tensor([0, 20])
    src, dst = path_moves(path, acc, base)
    want = expected_after(cache, src, dst)
    cache_d, path_d, acc_d, base_d = cache.cuda(), path.cuda(), acc.cuda(), base.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s, d = path_moves(path_d, acc_d, base_d)
        compact_kv(cache_d, s, d)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(cache_d.cpu(), want)


def test_ensure_many_writes_what_ensure_does_in_one_go():
    """A step's page crossings for several sessions in one block-table write: the same tables as one `ensure` per
    session; on an exhausted pool the sessions before the failing one keep (and have written) their pages."""
    one, many = (KVPool(1, 4, num_pages=12, page_size=4, max_sessions=4, max_session_len=32, dtype=torch.float32,
                        device="cpu") for _ in range(2))
    for p in (one, many):
        p.block_table.fill_(-7)  # poison: every written cell must be a real page
    rows = [one.open() for _ in range(3)]
    assert rows == [many.open() for _ in range(3)]
    for lens in ([5, 1, 9], [5, 8, 9], [13, 8, 12]):  # grows, stays, grows by several pages
        for r, n in zip(rows, lens):
            one.ensure(r, n)
        many.ensure_many(rows, lens)
        assert torch.equal(one.block_table, many.block_table) and one.used_pages == many.used_pages
    written = many.block_table[many.block_table >= 0].tolist()
    assert len(written) == many.used_pages == 9 and len(set(written)) == 9  # each page once
    with pytest.raises(KVCapacityError, match="exhausted"):
        many.ensure_many(rows, [17, 20, 12])  # the first row's page fits, the second's do not
    assert many.capacity(rows[0]) == 20 and int(many.block_table[rows[0], 4]) >= 0
    assert many.capacity(rows[1]) == 8 and int(many.block_table[rows[1], 2]) == -7
