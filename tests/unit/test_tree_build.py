"""build_tree against its enumeration and heap references, plus structural invariants."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.tree_build import (
    TreeBatch,
    best_first_heap_reference,
    build_tree,
    build_tree_reference,
    tree_size,
)

ENUM_CAP = 50_000  # max prefixes the enumeration reference may walk
MODES = ["continuous", "grid", "rows_equal", "flat", "neg_inf"]


def _prefixes(k: int, L: int) -> int:
    return sum(k**d for d in range(1, L + 1))


def make_logq(gen: torch.Generator, R: int, L: int, V: int, mode: str) -> torch.Tensor:
    """[R, L, V] float32 log-probs; the modes plant exact ties of different kinds."""
    lq = torch.log_softmax(torch.randn(R, L, V, generator=gen) * 2.0, dim=-1)
    if mode == "grid":  # coarse grid: many exact ties within and across depths
        lq = ((lq / 0.5).round() * 0.5).clamp(max=0.0)
    elif mode == "rows_equal":  # every depth the same row: path scores tie across parents
        lq = ((lq[:, :1, :] / 0.25).round() * 0.25).clamp(max=0.0).expand(R, L, V).clone()
    elif mode == "flat":  # whole rows constant: every candidate at a depth ties
        lq = torch.full((R, L, V), -1.0)
    elif mode == "neg_inf":  # -inf entries are still (very low) valid candidates
        lq = lq.masked_fill(torch.rand(R, L, V, generator=gen) < 0.4, float("-inf"))
    return lq


def as_lists(tree: TreeBatch, r: int) -> dict[str, list]:
    return {k: v.tolist() for k, v in tree.select(r).items()}


def check_invariants(tree: TreeBatch, roots: torch.Tensor, budgets, topks, L: int, V: int) -> None:
    R, M = tree.tokens.shape
    assert M == max(tree.n_nodes)
    for r in range(R):
        n = tree.n_nodes[r]
        assert n == tree_size(budgets[r], min(topks[r], V), L)
        assert tree.n_nodes_device()[r].item() == n
        t = as_lists(tree, r)
        assert t["parent"][0] == -1 and t["depth"][0] == 0 and t["logw"][0] == 0.0
        assert t["tokens"][0] == roots[r].item()
        children: dict[int, list[int]] = {}
        for i in range(1, n):
            p = t["parent"][i]
            assert 0 <= p < i, "parents precede children"
            assert t["depth"][i] == t["depth"][p] + 1 <= L
            assert t["logw"][i] <= t["logw"][p] and t["logw"][i] > float("-inf")
            assert 0 <= t["tokens"][i] < V
            children.setdefault(p, []).append(i)
        for i in range(n):
            kids = children.get(i, [])
            assert len({t["tokens"][c] for c in kids}) == len(kids), "siblings have distinct tokens"
            assert len(kids) <= topks[r]
            assert t["first_child"][i] == (kids[0] if kids else -1)
            for a, b in zip(kids, kids[1:] + [-1]):
                assert t["next_sibling"][a] == b
        assert t["next_sibling"][0] == -1
        # padding is fully marked
        for name, pad in (
            ("tokens", -1),
            ("parent", -1),
            ("depth", -1),
            ("first_child", -1),
            ("next_sibling", -1),
            ("logw", float("-inf")),
        ):
            assert getattr(tree, name)[r, n:].tolist() == [pad] * (M - n), name


def run_case(gen: torch.Generator, L: int, V: int, budgets, topks, mode: str) -> None:
    R = len(budgets)
    lq = make_logq(gen, R, L, V, mode)
    roots = torch.randint(0, V, (R,), generator=gen)
    tree = build_tree(lq, roots, budgets, topks)
    check_invariants(tree, roots, budgets, topks, L, V)
    for r in range(R):
        ref = build_tree_reference(lq[r], int(roots[r]), budgets[r], topks[r])
        got = as_lists(tree, r)
        assert got == ref, f"mode={mode} L={L} V={V} budget={budgets[r]} topk={topks[r]}\n{got}\n{ref}"


def test_tree_size():
    assert tree_size(0, 4, 5) == 1
    assert tree_size(64, 1, 3) == 4
    assert tree_size(10, 2, 3) == 11
    assert tree_size(20, 2, 3) == 15
    assert tree_size(5, 3, 0) == 1
    assert tree_size(5, 0, 4) == 1
    assert tree_size(7, 10**9, 10**9) == 8  # capped early, no giant powers
    assert tree_size(10**6, 1, 10**9) == 10**6 + 1
    with pytest.raises(ValueError):
        tree_size(-1, 2, 2)


def test_hand_built_exact():
    # depth 1: token 2 -> -1, token 0 -> -2, token 1 -> -4
    # depth 2: token 1 -> -1, tokens 0 and 2 tie at -3 (token 0 ranks first)
    lq = torch.tensor([[[-2.0, -4.0, -1.0], [-3.0, -1.0, -3.0]]])
    tree = build_tree(lq, torch.tensor([7]), budgets=[5], topks=[2])
    # scores: [2]=-1, [0]=-2, [2,1]=-2 (deeper, after [0]), [0,1]=-3, [2,0]=-4, [0,0]=-5 (cut)
    assert as_lists(tree, 0) == {
        "tokens": [7, 2, 0, 1, 1, 0],
        "parent": [-1, 0, 0, 1, 2, 1],
        "depth": [0, 1, 1, 2, 2, 2],
        "first_child": [1, 3, 4, -1, -1, -1],
        "next_sibling": [-1, 2, -1, 5, -1, -1],
        "logw": [0.0, -1.0, -2.0, -2.0, -3.0, -4.0],
    }
    assert as_lists(tree, 0) == build_tree_reference(lq[0], 7, 5, 2)


@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_random_batches(mode):
    seed = MODES.index(mode)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    for _ in range(25):
        L = rng.randint(1, 15)
        V = rng.randint(5, 40)
        R = rng.randint(1, 4)
        kmax = max([k for k in range(1, 9) if _prefixes(k, L) <= ENUM_CAP // 4] + [1])
        budgets = [rng.choice([0, 1, 2, rng.randint(1, 64), 64]) for _ in range(R)]
        topks = [rng.randint(1, kmax) for _ in range(R)]
        run_case(gen, L, V, budgets, topks, mode)


@pytest.mark.parametrize(
    "L,V,budgets,topks",
    [
        (3, 5, [64], [1]),  # capacity 3 < budget: 4 nodes
        (2, 5, [64, 3], [5, 5]),  # topk = V: full enumeration capacity 30
        (2, 5, [64], [8]),  # topk > V is capped at V
        (1, 40, [64, 1, 0], [8, 8, 8]),
        (15, 6, [64, 10, 33], [1, 2, 2]),  # deep, narrow
        (14, 5, [64], [2]),  # ~32k prefixes: the largest enumeration
        (4, 7, [0, 0], [3, 3]),  # root-only trees
    ],
)
@pytest.mark.parametrize("mode", ["continuous", "grid", "flat"])
def test_matches_reference_edges(L, V, budgets, topks, mode):
    run_case(torch.Generator().manual_seed(L * 100 + V), L, V, budgets, topks, mode)


def _tie_free(lq: torch.Tensor, topk: int) -> bool:
    ref = build_tree_reference(lq, 0, 10**9, topk)  # every prefix
    return len(set(ref["logw"])) == len(ref["logw"])


def test_matches_best_first_heap_without_ties():
    gen = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    checked = 0
    for _ in range(60):
        L, V = rng.randint(1, 6), rng.randint(5, 30)
        topk = rng.randint(1, 4)
        lq = make_logq(gen, 1, L, V, "continuous")
        if _prefixes(topk, L) > 2000 or not _tie_free(lq[0], topk):
            continue
        budget = rng.randint(1, 64)
        tree = build_tree(lq, torch.tensor([1]), [budget], [topk])
        heap = best_first_heap_reference(lq[0], 1, budget, topk)
        assert as_lists(tree, 0) == heap
        checked += 1
    assert checked >= 30


@settings(max_examples=60, deadline=None)
@given(
    L=st.integers(1, 5),
    V=st.integers(2, 9),
    data=st.data(),
)
def test_hypothesis_grid_values(L, V, data):
    """Log-probs drawn from a 4-value grid: ties everywhere; shrinks to a minimal failure."""
    R = data.draw(st.integers(1, 3))
    vals = data.draw(
        st.lists(st.sampled_from([0.0, -0.5, -1.0, float("-inf")]), min_size=R * L * V, max_size=R * L * V)
    )
    lq = torch.tensor(vals, dtype=torch.float32).reshape(R, L, V)
    budgets = data.draw(st.lists(st.integers(0, 40), min_size=R, max_size=R))
    topks = data.draw(st.lists(st.integers(1, 4), min_size=R, max_size=R))
    roots = torch.arange(R)
    tree = build_tree(lq, roots, budgets, topks)
    check_invariants(tree, roots, budgets, topks, L, V)
    for r in range(R):
        assert as_lists(tree, r) == build_tree_reference(lq[r], r, budgets[r], topks[r])


def test_bf16_input_and_helpers():
    gen = torch.Generator().manual_seed(5)
    lq = make_logq(gen, 2, 3, 11, "continuous").bfloat16()
    tree = build_tree(lq, torch.tensor([1, 2]), [9, 20], [3, 2])
    for r in range(2):
        assert as_lists(tree, r) == build_tree_reference(lq[r], r + 1, [9, 20][r], [3, 2][r])
    moved = tree.to("cpu")
    assert moved.n_nodes == tree.n_nodes and torch.equal(moved.parent, tree.parent)
    assert tree.tokens.dtype == torch.int32 and tree.logw.dtype == torch.float32


def test_rejects_mismatched_lists():
    with pytest.raises(ValueError):
        build_tree(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long), [1], [1, 1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_no_host_sync_and_matches_cpu():
    gen = torch.Generator().manual_seed(11)
    lq = make_logq(gen, 3, 6, 50, "grid")
    roots = torch.tensor([1, 2, 3])
    budgets, topks = [64, 7, 30], [4, 8, 2]
    cpu = build_tree(lq, roots, budgets, topks)
    lq_d, roots_d = lq.cuda(), roots.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dev = build_tree(lq_d, roots_d, budgets, topks)
        n_dev = dev.n_nodes_device()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    back = dev.to("cpu")
    for f in TreeBatch._FIELDS:
        assert torch.equal(getattr(back, f), getattr(cpu, f)), f
    assert n_dev.tolist() == cpu.n_nodes
