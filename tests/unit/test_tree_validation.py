"""`validate_trees`: every rule a tree from the wire must satisfy, one invalid case at a time.

Each case breaks row 1 of a batch of three real trees (from `build_tree`) and checks that exactly
that row is reported, with a message that says what is wrong; the other rows stay valid.
"""

from __future__ import annotations

import pytest
import torch

from kernels.tree_build import TreeBatch, build_tree, tree_size
from verifier_service.tree_validation import validate_trees

V, L = 40, 6
ROOTS = [3, 5, 7]
BUDGETS, TOPKS = [16, 12, 8], [4, 3, 2]


def make(seed=0) -> TreeBatch:
    g = torch.Generator().manual_seed(seed)
    logq = torch.log_softmax(torch.randn(3, L, V, generator=g), -1)
    return build_tree(logq, torch.tensor(ROOTS), BUDGETS, TOPKS)


def check(tb: TreeBatch, caps=None):
    caps = caps or [tree_size(b, k, L) for b, k in zip(BUDGETS, TOPKS)]
    return validate_trees(tb, ROOTS, caps, V, L)


def siblings(tb: TreeBatch, r: int) -> tuple[int, int]:
    """Two nodes of row r with the same parent (the first pair found)."""
    par = tb.parent[r, : tb.n_nodes[r]].tolist()
    for i in range(1, len(par)):
        for j in range(i + 1, len(par)):
            if par[i] == par[j]:
                return i, j
    raise AssertionError("row has no siblings")


def set_(field, idx, value):
    def f(tb):
        getattr(tb, field)[1, idx] = value
    return f


def with_n(n):
    def f(tb):
        tb.n_nodes[1] = n
    return f


def dup_sibling(tb):
    i, j = siblings(tb, 1)
    tb.tokens[1, j] = tb.tokens[1, i]


def swap_fc(tb):
    i, _ = siblings(tb, 1)
    p = int(tb.parent[1, i])
    tb.first_child[1, p] = tb.next_sibling[1, i]  # a child, but not the first one


def break_ns(tb):
    i, j = siblings(tb, 1)
    tb.next_sibling[1, i] = -1


def raise_logw(tb):
    last = tb.n_nodes[1] - 1
    tb.logw[1, last] = tb.logw[1, int(tb.parent[1, last])] + 0.5


CASES = [
    ("n_nodes over the budget", with_n(tree_size(12, 3, L) + 1), "is outside 1.."),
    ("no nodes", with_n(0), "n_nodes 0"),
    ("root token", set_("tokens", 0, 9), "root token 9"),
    ("root parent", set_("parent", 0, 2), "node 0 must be the root"),
    ("root depth", set_("depth", 0, 1), "node 0 must be the root"),
    ("root logw", set_("logw", 0, -0.5), "root logw"),
    ("self parent", set_("parent", 4, 4), "not an earlier node"),
    ("forward parent", set_("parent", 3, 7), "not an earlier node"),
    ("second root", set_("parent", 5, -1), "not an earlier node"),
    ("parent out of range", set_("parent", 2, 1000), "not an earlier node"),
    ("depth vs parent", set_("depth", 3, 5), "but its parent"),
    ("token id negative", set_("tokens", 2, -4), "outside the vocabulary"),
    ("token id past the vocabulary", set_("tokens", 2, V), "outside the vocabulary"),
    ("logw nan", set_("logw", 3, float("nan")), "non-finite logw"),
    ("logw -inf", set_("logw", 3, float("-inf")), "non-finite logw"),
    ("logw rises along an edge", raise_logw, "above its parent"),
    ("siblings repeat a token", dup_sibling, "repeats the token"),
    ("first_child", swap_fc, "first_child"),
    ("next_sibling", break_ns, "next_sibling"),
    ("padding", lambda tb: tb.tokens.__setitem__((1, tb.n_nodes[1]), 4), "padding column"),
]


def test_valid_trees_pass():
    for seed in range(5):
        assert check(make(seed)) == [None, None, None]


def test_a_smaller_tree_than_the_budget_is_valid():
    """The drafter may send fewer nodes than the budget allows (a prefix of its node order)."""
    tb = make()
    n = 4
    tb.n_nodes[1] = n
    for f in ("tokens", "parent", "depth"):
        getattr(tb, f)[1, n:] = -1
    tb.logw[1, n:] = float("-inf")
    fc, ns = tb.first_child[1], tb.next_sibling[1]
    fc[fc >= n], ns[ns >= n] = -1, -1
    fc[n:], ns[n:] = -1, -1
    assert check(tb) == [None, None, None]


@pytest.mark.parametrize("name, mutate, words", CASES, ids=[c[0] for c in CASES])
def test_each_invalid_tree_is_reported_for_its_row_only(name, mutate, words):
    tb = make()
    mutate(tb)
    errors = check(tb)
    assert errors[0] is None and errors[2] is None, errors
    assert errors[1] is not None and words in errors[1], errors[1]


def test_depth_beyond_the_drafter():
    tb = make()
    deepest = [int(tb.depth[r].max()) for r in range(3)]
    errors = validate_trees(tb, ROOTS, [tree_size(b, k, L) for b, k in zip(BUDGETS, TOPKS)], V, deepest[1] - 1)
    assert errors[1] is not None and f"> the drafter's {deepest[1] - 1}" in errors[1]


def test_cap_comes_from_the_caller():
    tb = make()
    errors = check(tb, caps=[tree_size(16, 4, L), 3, tree_size(8, 2, L)])
    assert errors[1] is not None and "n_nodes 13" in errors[1] and "1..3" in errors[1]


def test_empty_arrays():
    z = torch.empty(1, 0, dtype=torch.int32)
    tb = TreeBatch(z, z, z, z, z, torch.empty(1, 0), [1])
    assert "n_nodes 1" in validate_trees(tb, [3], [17], V, L)[0]
