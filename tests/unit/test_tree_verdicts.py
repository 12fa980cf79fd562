"""`TreeChecker`: host-refused rows at once, device-refused rows neutralised now and reported later.

Rows of a real batch (`build_tree`) are broken one way each: a node count past the budget (refused on the
host, never verified from this batch), a token outside the vocabulary and a repeated sibling (refused by the
device check: verified as root plus unacceptable nodes, reported by `verdicts` with the host rules' message).
"""

from __future__ import annotations

import torch

from kernels.tree_build import TreeBatch, build_tree, tree_size
from verifier_service.tree_verdicts import TreeChecker

V, L = 40, 6
ROOTS = [3, 5, 7, 9]
BUDGETS, TOPKS = [16, 12, 8, 6], [4, 3, 2, 2]
IDS = ["ok", "count", "vocab", "sibling"]


def batch() -> TreeBatch:
    g = torch.Generator().manual_seed(3)
    logq = torch.log_softmax(torch.randn(4, L, V, generator=g), -1)
    return build_tree(logq, torch.tensor(ROOTS), BUDGETS, TOPKS)


def caps() -> list[int]:
    return [tree_size(b, k, L) for b, k in zip(BUDGETS, TOPKS)]


def siblings(tb: TreeBatch, r: int) -> tuple[int, int]:
    par = tb.parent[r, : tb.n_nodes[r]].tolist()
    return next((i, j) for i in range(1, len(par)) for j in range(i + 1, len(par)) if par[i] == par[j])


def test_valid_batch_passes_untouched():
    tb = batch()
    checker = TreeChecker(V, L)
    safe, refused = checker.check(IDS, tb, ROOTS, caps())
    assert refused == {} and checker.verdicts() == {}
    for f in ("tokens", "parent", "depth"):
        assert torch.equal(getattr(safe, f), getattr(tb, f)), f


def test_each_kind_of_refusal():
    tb = batch()
    original = {f: getattr(tb, f).clone() for f in TreeBatch._FIELDS}
    tb.n_nodes[1] = caps()[1] + 1
    tb.tokens[2, 3] = V
    i, j = siblings(tb, 3)
    tb.tokens[3, j] = tb.tokens[3, i]
    checker = TreeChecker(V, L)
    safe, refused = checker.check(IDS, tb, ROOTS, caps())
    assert list(refused) == ["count"] and "is outside 1.." in refused["count"]
    for r in (2, 3):  # refused on the device: the root, then nodes no posterior token can match
        n = tb.n_nodes[r]
        assert safe.tokens[r, 0] == ROOTS[r] and (safe.tokens[r, 1:n] == -1).all()
        assert (safe.parent[r, 1:n] == 0).all() and (safe.depth[r, 1:n] == 1).all()
    assert torch.equal(safe.tokens[0], tb.tokens[0])
    bad = checker.verdicts()
    assert sorted(bad) == ["sibling", "vocab"]  # "count" was told already, by check()
    assert "outside the vocabulary" in bad["vocab"] and "repeats the token" in bad["sibling"]
    assert checker.verdicts() == {}  # read once
    assert torch.equal(tb.parent, original["parent"]) and torch.equal(tb.logw, original["logw"])  # inputs kept


def test_arrays_wider_than_any_tree_refuse_the_batch():
    z = torch.full((2, 300), -1, dtype=torch.int32)
    tb = TreeBatch(z, z, z, z, z, torch.full((2, 300), float("-inf")), [1, 1])
    _, refused = TreeChecker(V, L).check(["a", "b"], tb, [1, 2], [17, 17])
    assert set(refused) == {"a", "b"} and "300 columns" in refused["a"]
