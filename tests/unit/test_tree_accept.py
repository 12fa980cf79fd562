"""accept_greedy on hand-built and random trees; ancestor masks and their bit packing."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.tree_accept import accept_greedy, accept_reference
from kernels.tree_build import build_tree
from kernels.tree_mask import ancestor_mask, pack_mask_bits, unpack_mask_bits

# Hand-built tree (M = 8, nodes 7 is padding with absurd values):
#            0 (tok 100)
#          /            \
#     1 (tok 5)       2 (tok 6)
#        |               |
#     3 (tok 7)       4 (tok 8)
#        |               |
#     6 (tok 10)      5 (tok 9)
TOKENS = [100, 5, 6, 7, 8, 9, 10, 9]
PARENT = [-1, 0, 0, 1, 2, 4, 3, 6]
MAXD = 3


def _post(**kv: int) -> list[int]:
    """Posterior row: 1000 + i by default (matches no token), overridden per node as y<i>=tok."""
    y = [1000 + i for i in range(len(TOKENS))]
    for k, v in kv.items():
        y[int(k[1:])] = v
    return y


# (name, n_nodes, posterior, accept_len, path, bonus)
HAND_CASES = [
    ("reject_at_root", 7, _post(y0=42), 0, [0, -1, -1, -1], 42),
    ("depth1", 7, _post(y0=5, y1=99), 1, [0, 1, -1, -1], 99),
    ("depth2", 7, _post(y0=5, y1=7, y3=55), 2, [0, 1, 3, -1], 55),
    ("depth3_bonus_after_leaf", 7, _post(y0=5, y1=7, y3=10, y6=77), 3, [0, 1, 3, 6], 77),
    ("other_branch_depth2", 7, _post(y0=6, y2=8, y4=11), 2, [0, 2, 4, -1], 11),
    # branch 2-4-5 is internally consistent and deeper, but node 2 fails: must not win
    ("wrong_sibling_deeper", 7, _post(y0=5, y1=7, y3=123, y2=8, y4=9, y5=1), 2, [0, 1, 3, -1], 123),
    # n_nodes = 5: nodes 5..7 are padding even though their tokens match
    ("padding_never_accepted", 5, _post(y0=6, y2=8, y4=9, y5=1), 2, [0, 2, 4, -1], 9),
    ("padding_under_leaf", 7, _post(y0=5, y1=7, y3=10, y6=9), 3, [0, 1, 3, 6], 9),
]


def _run(n_nodes, post, tokens=TOKENS, parent=PARENT, max_depth=MAXD, dtype=torch.int64):
    R = len(n_nodes)
    return accept_greedy(
        torch.tensor([tokens] * R, dtype=torch.int32),
        torch.tensor([parent] * R, dtype=torch.int32),
        torch.tensor(n_nodes),
        torch.tensor(post, dtype=dtype),
        max_depth,
    )


@pytest.mark.parametrize("case", HAND_CASES, ids=[c[0] for c in HAND_CASES])
def test_hand_built(case):
    _, n, post, acc, path, bonus = case
    res = _run([n], [post])
    assert res.accept_len.tolist() == [acc]
    assert res.path.tolist() == [path]
    assert res.bonus.tolist() == [bonus]
    assert res.last.tolist() == [path[acc]]
    assert accept_reference(TOKENS, PARENT, n, post, MAXD) == (acc, path, bonus)


def test_hand_built_batched_int32_posterior():
    res = _run([c[1] for c in HAND_CASES], [c[2] for c in HAND_CASES], dtype=torch.int32)
    assert res.accept_len.tolist() == [c[3] for c in HAND_CASES]
    assert res.path.tolist() == [c[4] for c in HAND_CASES]
    assert res.bonus.tolist() == [c[5] for c in HAND_CASES]
    assert res.accept_len.dtype == res.path.dtype == res.bonus.dtype == torch.int32


def test_max_depth_bounds_acceptance():
    post = _post(y0=5, y1=7, y3=10, y6=77)
    res = _run([7], [post], max_depth=2)
    assert (res.accept_len.tolist(), res.path.tolist(), res.bonus.tolist()) == ([2], [[0, 1, 3]], [10])
    assert accept_reference(TOKENS, PARENT, 7, post, 2) == (2, [0, 1, 3], 10)


def test_root_only_trees():
    res = _run([1, 1], [_post(y0=5), _post(y0=3)])
    assert res.accept_len.tolist() == [0, 0] and res.bonus.tolist() == [5, 3]
    assert res.path[:, 0].tolist() == [0, 0] and (res.path[:, 1:] == -1).all()


def _follow(tree, r: int, rng: random.Random, V: int) -> tuple[list[int], int]:
    """Posterior that follows a random root-to-node path of the tree, then leaves it."""
    n = tree.n_nodes[r]
    tok, fc, ns = (tree.select(r)[k].tolist() for k in ("tokens", "first_child", "next_sibling"))
    post = [rng.randrange(V) for _ in range(tree.tokens.shape[1])]
    cur, steps, target = 0, 0, rng.randint(0, 15)
    while steps < target and fc[cur] != -1:
        kids = [fc[cur]]
        while ns[kids[-1]] != -1:
            kids.append(ns[kids[-1]])
        nxt = rng.choice(kids)
        post[cur] = tok[nxt]
        cur, steps = nxt, steps + 1
    if rng.random() < 0.7:  # leave the tree on purpose (a token no child has); else stay random
        kid_toks = {tok[c] for c in range(n) if tree.parent[r, c].item() == cur}
        post[cur] = next(v for v in range(V + 1) if v not in kid_toks)
    return post, steps


@pytest.mark.parametrize("seed", range(6))
def test_random_trees_match_reference(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(8):
        R, L, V = rng.randint(1, 5), rng.randint(1, 8), rng.randint(3, 12)
        lq = torch.log_softmax(torch.randn(R, L, V, generator=gen), -1)
        if seed % 2:
            lq = ((lq / 0.5).round() * 0.5).clamp(max=0.0)
        budgets = [rng.randint(0, 64) for _ in range(R)]
        topks = [rng.randint(1, 5) for _ in range(R)]
        tree = build_tree(lq, torch.randint(0, V, (R,), generator=gen), budgets, topks)
        posts, steps = zip(*(_follow(tree, r, rng, V) for r in range(R)))
        res = accept_greedy(tree.tokens, tree.parent, tree.n_nodes_device(), torch.tensor(posts), L)
        for r in range(R):
            n = tree.n_nodes[r]
            want = accept_reference(tree.tokens[r].tolist(), tree.parent[r].tolist(), n, list(posts[r]), L)
            got = (res.accept_len[r].item(), res.path[r].tolist(), res.bonus[r].item())
            assert got == want
            assert got[0] >= steps[r]  # the planted path is accepted (maybe further, if random)


def _ancestors_walk(parent: list[int]) -> list[list[bool]]:
    M = len(parent)
    rows = []
    for i in range(M):
        row, cur = [False] * M, i
        while 0 <= cur < M:
            row[cur] = True
            cur = parent[cur]
        rows.append(row)
    return rows


@pytest.mark.parametrize("M", [1, 2, 3, 9, 64, 65, 130])
def test_ancestor_mask_matches_walk(M):
    rng = random.Random(M)
    rows = []
    for shape in ("chain", "random", "forest_shuffled"):
        if shape == "chain":
            parent = [i - 1 for i in range(M)]
        elif shape == "random":
            parent = [-1] + [rng.randrange(i) for i in range(1, M)]
            for i in range(rng.randint(0, M // 2)):  # trailing padding
                parent[M - 1 - i] = -1
        else:  # a forest in no topological order, some parents out of range (treated as -1)
            perm = list(range(M))
            rng.shuffle(perm)
            base = [-1] + [rng.randrange(i) for i in range(1, M)]
            parent = [-1] * M
            for i in range(M):
                parent[perm[i]] = perm[base[i]] if base[i] >= 0 and rng.random() > 0.1 else -1
            if M > 2:
                parent[perm[-1]] = M + 5
        rows.append(parent)
    mask = ancestor_mask(torch.tensor(rows, dtype=torch.int32))
    assert mask.shape == (3, M, M) and mask.dtype == torch.bool
    for r, parent in enumerate(rows):
        clean = [p if 0 <= p < M else -1 for p in parent]
        assert mask[r].tolist() == _ancestors_walk(clean)


@pytest.mark.parametrize("M", [1, 9, 63, 64, 65, 129])
def test_pack_unpack_round_trip(M):
    gen = torch.Generator().manual_seed(M)
    mask = torch.rand(3, M, M, generator=gen) < 0.5
    mask[0] = True  # every bit set: word 0 is -1 when M >= 64
    words = pack_mask_bits(mask)
    assert words.shape == (3, M, (M + 63) // 64) and words.dtype == torch.int64
    assert torch.equal(unpack_mask_bits(words), mask)
    for r, i in ((1, 0), (2, M - 1)):  # bit layout: bit k of word w = column 64*w + k
        for w in range(words.shape[-1]):
            val = sum(1 << k for k in range(64) if 64 * w + k < M and mask[r, i, 64 * w + k])
            assert words[r, i, w].item() == (val - (1 << 64) if val >= 1 << 63 else val)


def test_pack_bit_positions():
    mask = torch.zeros(1, 65, 65, dtype=torch.bool)
    mask[0, 0, 63] = True
    mask[0, 1, 64] = True
    mask[0, 2, 0] = True
    words = pack_mask_bits(mask)
    assert words[0, 0].tolist() == [-(1 << 63), 0]
    assert words[0, 1].tolist() == [0, 1]
    assert words[0, 2].tolist() == [1, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_no_host_sync_and_matches_cpu():
    n, post = [c[1] for c in HAND_CASES], [c[2] for c in HAND_CASES]
    R = len(n)
    args = (
        torch.tensor([TOKENS] * R, dtype=torch.int32),
        torch.tensor([PARENT] * R, dtype=torch.int32),
        torch.tensor(n),
        torch.tensor(post),
    )
    cpu = accept_greedy(*args, MAXD)
    dargs = [a.cuda() for a in args]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dev = accept_greedy(*dargs, MAXD)
        mask = ancestor_mask(dargs[1])
        words = pack_mask_bits(mask)
        back = unpack_mask_bits(words)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for f in ("accept_len", "path", "bonus", "last"):
        assert torch.equal(getattr(dev, f).cpu(), getattr(cpu, f)), f
    assert torch.equal(mask.cpu(), ancestor_mask(args[1])) and torch.equal(back, mask)
