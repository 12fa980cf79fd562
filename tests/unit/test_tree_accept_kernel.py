"""kernels.tree_accept.accept_tree's Triton kernel (TRITON_INTERPRET=1 on CPU, the GPU where there is one) gives
`accept_greedy`'s accept lengths, paths, bonus tokens and deepest nodes exactly: on the hand-built cases, on drafter
trees whose posterior follows them to every depth (and past max_depth), on refused and root-only rows, and on parent
arrays no check would pass (cycles, pointers out of range), where both must still agree node for node."""

from __future__ import annotations

import pytest
import torch

from kernels.tree_accept import accept_greedy, accept_tree
from kernels.tree_build import build_tree
from tests.unit.test_tree_accept import HAND_CASES, MAXD, PARENT, TOKENS

FIELDS = ("accept_len", "path", "bonus", "last")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _same(want, got):
    for f in FIELDS:
        w, o = getattr(want, f), getattr(got, f)
        assert o.dtype == torch.int32 and o.shape == w.shape and torch.equal(o.cpu(), w.cpu()), (f, w, o)


def _trees(R, budget, seed, follow, garbage=False):
    """Drafter trees as the engine lays them out (int64 [R, M]), n_nodes [R], and a posterior that follows each tree
    from the root with probability `follow` per node (deep acceptance), random elsewhere."""
    g = torch.Generator().manual_seed(seed)
    roots = torch.randint(0, 50, (R,), generator=g)
    budgets = [max(1, budget - 5 * r) for r in range(R)]
    trees = build_tree(torch.log_softmax(3 * torch.randn(R, 15, 50, generator=g), -1), roots, budgets, [4] * R)
    tok, parent = trees.tokens.long(), trees.parent.long()
    n = torch.tensor(trees.n_nodes)
    M = tok.shape[1]
    post = torch.randint(0, 50, (R, M), generator=g)
    for r in range(R):
        for i in range(1, int(n[r])):  # off-path agreement: other branches match here and there too
            if torch.rand(1, generator=g).item() < follow / 2:
                post[r, parent[r, i]] = tok[r, i]
        cur = 0  # a path the posterior follows from the root, one random child at a time, with prob. `follow`
        while torch.rand(1, generator=g).item() < follow:
            kids = [i for i in range(1, int(n[r])) if parent[r, i] == cur]
            if not kids:
                break
            inner = [k for k in kids if any(parent[r, j] == k for j in range(1, int(n[r])))]
            kids = inner or kids  # a child with children of its own where there is one: deeper paths
            nxt = kids[int(torch.randint(0, len(kids), (1,), generator=g))]
            post[r, cur], cur = tok[r, nxt], nxt
    if R > 1:  # a refused tree: root, then token -1 under it
        tok[1, 1 : n[1]], parent[1, 1 : n[1]] = -1, 0
    if R > 2:  # a root-only row
        n[2] = 1
    if garbage:
        parent = torch.randint(-3, M + 3, parent.shape, generator=g)
        n = torch.randint(0, M + 1, (R,), generator=g)
    return tok, parent, n, post


@pytest.mark.parametrize("name,n_nodes,post,want_len,want_path,want_bonus", HAND_CASES, ids=[c[0] for c in HAND_CASES])
def test_the_hand_built_cases(name, n_nodes, post, want_len, want_path, want_bonus):
    args = (torch.tensor([TOKENS]), torch.tensor([PARENT]), torch.tensor([n_nodes]), torch.tensor([post]))
    got = accept_tree(*args, MAXD, impl="triton")
    _same(accept_greedy(*args, MAXD), got)
    assert (got.accept_len.item(), got.path[0].tolist(), got.bonus.item()) == (want_len, want_path, want_bonus)


@pytest.mark.parametrize("R,budget,max_depth,follow,garbage", [
    (1, 1, 15, 0.9, False), (1, 16, 15, 0.95, False), (3, 33, 15, 0.9, False), (4, 64, 15, 0.85, False),
    (2, 70, 15, 0.9, False), (5, 24, 3, 0.95, False), (3, 40, 0, 0.9, False),  # paths cut at max_depth
    (5, 24, 15, 0.5, True), (2, 66, 7, 0.9, True), (9, 17, 15, 0.3, False)])
def test_the_kernel_gives_the_torch_codes_results(R, budget, max_depth, follow, garbage):
    tok, parent, n, post = _trees(R, budget, R * 1000 + budget, follow, garbage)
    want = accept_greedy(tok, parent, n, post, max_depth)
    got = accept_tree(tok, parent, n, post, max_depth, impl="triton")
    _same(want, got)


def test_every_depth_is_reached_and_rejected():
    """Over many seeds the accepted lengths cover 0..max_depth (the deepest ones cut there), each matched by the
    kernel."""
    seen = set()
    for seed in range(32):
        tok, parent, n, post = _trees(2, 64, seed, 0.5 + 0.015 * seed)
        want = accept_greedy(tok, parent, n, post, 4)
        _same(want, accept_tree(tok, parent, n, post, 4, impl="triton"))
        seen.update(want.accept_len.tolist())
    assert seen == set(range(5)), sorted(seen)


def test_a_node_with_no_parent_is_never_ok_but_the_root():
    """Node 1 points nowhere (-1, and 7 past M: a second "root") and carries the token the root's posterior names; its
    child agrees with it. Only the real root is ok without a parent, so nothing under node 1 is accepted."""
    for bad in (-1, 7):
        tok, parent = torch.tensor([[100, 5, 6, 8]]), torch.tensor([[-1, bad, 1, 0]])
        post = torch.tensor([[5, 6, 0, 0]])
        want = accept_greedy(tok, parent, torch.tensor([4]), post, 3)
        _same(want, accept_tree(tok, parent, torch.tensor([4]), post, 3, impl="triton"))
        assert want.accept_len.item() == 0 and want.bonus.item() == 5


def test_a_chain_through_the_second_bit_word():
    """A 70-node chain the posterior follows to its end: ancestor sets cross word 0's sign bit into word 1."""
    M = 70
    tok = torch.arange(M)[None, :] + 100
    parent = torch.arange(-1, M - 1)[None, :]
    post = torch.arange(M)[None, :] + 101  # node i's posterior is node i + 1's token
    for max_depth in (68, 69, 70):
        want = accept_greedy(tok, parent, torch.tensor([M]), post, max_depth)
        _same(want, accept_tree(tok, parent, torch.tensor([M]), post, max_depth, impl="triton"))
        assert want.accept_len.item() == min(max_depth, M - 1)


def test_the_launcher_checks_its_arguments_and_takes_empty_batches():
    tok, parent, n, post = _trees(2, 9, 5, 0.9)
    with pytest.raises(ValueError, match="impl"):
        accept_tree(tok, parent, n, post, 3, impl="fast")
    with pytest.raises(ValueError, match="shapes"):
        accept_tree(tok, parent[:, :-1], n, post, 3, impl="triton")
    empty = accept_tree(tok[:0], parent[:0], n[:0], post[:0], 3, impl="triton")
    assert empty.path.shape == (0, 4) and empty.accept_len.shape == (0,)
    _same(accept_greedy(tok, parent, n, post, 3), accept_tree(tok, parent, n, post, 3, impl="torch"))


@pytest.mark.gpu
@gpu
def test_gpu_kernel_matches_the_torch_code_at_64_sessions_with_no_host_wait():
    tok, parent, n, post = (t.cuda() for t in _trees(64, 65, 7, 0.9))
    want = accept_greedy(tok, parent, n, post, 15)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = accept_tree(tok, parent, n, post, 15)  # auto: the kernel on CUDA
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _same(want, got)
