"""kernels.kv_compact.commit_moves: a verify step's KV moves as physical slots. Its Triton kernel (TRITON_INTERPRET=1 on
CPU, the GPU where there is one) gives the torch reference's slots exactly (the engine's former inline code:
`path_moves`, the block table's translation, the scratch slot for padding), across page boundaries, with paths cut
short and refused (root-only) rows; and the moves it gives commit the accepted path."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_compact import block_slots, commit_moves, commit_moves_reference, compact_kv
from verifier_service.kv_cache import KVPool

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _step(S, D1, page_size, seed):
    """A pool with S sessions at random committed lengths (pages allocated for their trees) and accepted paths."""
    g = torch.Generator().manual_seed(seed)
    max_len = 5 * page_size + 3 * D1
    pool = KVPool(1, 4, num_pages=S * (max_len // page_size + 1), page_size=page_size, max_sessions=S,
                  max_session_len=max_len, dtype=torch.float32, device="cpu")
    rows, committed = [], []
    for _ in range(S):
        row = pool.open()
        L = int(torch.randint(0, 5 * page_size, (1,), generator=g))
        pool.ensure_many([row], [L + 3 * D1])
        rows.append(row)
        committed.append(L)
    accept_len = torch.randint(0, D1, (S,), generator=g)
    path = torch.full((S, D1), -1, dtype=torch.int64)
    for s in range(S):  # strictly increasing node indices along the path, as a tree's are
        nodes = sorted(torch.randperm(3 * D1 - 1, generator=g)[: int(accept_len[s])].add(1).tolist())
        path[s, : int(accept_len[s]) + 1] = torch.tensor([0, *nodes])
    return pool, path.to(torch.int32), accept_len.to(torch.int32), torch.tensor(rows), torch.tensor(committed)


@pytest.mark.parametrize("S,D1,page_size", [(1, 16, 16), (3, 16, 4), (5, 8, 16), (2, 33, 8), (7, 1, 16)])
def test_the_kernel_gives_the_references_slots(S, D1, page_size):
    pool, path, acc, rows, committed = _step(S, D1, page_size, S * 100 + D1)
    args = (path, acc, rows, committed, pool.block_table, page_size, pool.scratch_slot)
    want = commit_moves_reference(*args)
    got = commit_moves(*args, impl="triton")
    for w, o in zip(want, got):
        assert o.dtype == torch.int64 and o.shape == w.shape and torch.equal(o, w)
    assert (want[0] == pool.scratch_slot).sum() == (want[1] == pool.scratch_slot).sum() == \
        int((torch.arange(D1)[None, :] > acc.long()[:, None]).sum())  # padding moves: scratch onto scratch


def test_the_moves_commit_the_accepted_path_across_pages():
    """Write each tree node's index at its slot, apply the moves: the committed rows hold the path, in order."""
    pool, path, acc, rows, committed = _step(4, 16, 4, 11)
    cache = torch.full((1, pool.scratch_slot + 4, 1), -1.0)
    for s in range(4):
        logical = committed[s] + torch.arange(48)
        cache[0, block_slots(pool.block_table, 4, rows[s : s + 1], logical[None, :])[0], 0] = torch.arange(48.0)
    src, dst = commit_moves(path, acc, rows, committed, pool.block_table, 4, pool.scratch_slot, impl="triton")
    compact_kv(cache, src.view(-1), dst.view(-1))
    for s in range(4):
        a = int(acc[s])
        kept = block_slots(pool.block_table, 4, rows[s : s + 1], (committed[s] + torch.arange(a + 1))[None, :])[0]
        assert cache[0, kept, 0].long().tolist() == path[s, : a + 1].tolist()


def test_the_launcher_checks_its_arguments():
    pool, path, acc, rows, committed = _step(2, 8, 16, 3)
    with pytest.raises(ValueError, match="impl"):
        commit_moves(path, acc, rows, committed, pool.block_table, 16, pool.scratch_slot, impl="fast")
    with pytest.raises(ValueError, match="shapes"):
        commit_moves(path, acc[:1], rows, committed, pool.block_table, 16, pool.scratch_slot, impl="triton")


@pytest.mark.gpu
@gpu
def test_gpu_kernel_matches_the_reference_with_no_host_wait():
    pool, path, acc, rows, committed = _step(16, 16, 16, 5)
    args = [t.cuda() for t in (path, acc, rows, committed, pool.block_table)] + [16, pool.scratch_slot]
    want = commit_moves_reference(*args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = commit_moves(*args)  # auto: the kernel on CUDA
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for w, o in zip(want, got):
        assert torch.equal(o, w)
