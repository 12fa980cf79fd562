"""`TreeChecker`: host-refused rows at once, device-refused rows neutralised now and reported later.

Rows of a real batch (`build_tree`) are broken one way each: a node count past the budget (refused on the
host, never verified from this batch), a token outside the vocabulary and a repeated sibling (refused by the
device check: verified as root plus unacceptable nodes, reported by `verdicts` with the host rules' message).
"""

from __future__ import annotations

import pytest
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


def test_counts_uploaded_ahead_are_used_only_for_the_batch_they_describe(monkeypatch):
    """expect() uploads node counts and roots while the drafter works; check() uses them only when the answer is
    those sessions, in that order, with those roots and full trees: otherwise it uploads the real counts, so
    the verdicts never depend on the guess (a stale count would misjudge the padding rule)."""
    from verifier_service import tree_verdicts

    uploads = []
    real = tree_verdicts.int64_to_device
    monkeypatch.setattr(tree_verdicts, "int64_to_device",
                        lambda v, d, out=None: (uploads.append(v), real(v, d, out))[1])

    def run(expect_ids, expect_roots, mutate=None):
        tb = batch()
        if mutate is not None:
            mutate(tb)
        checker = TreeChecker(V, L)
        checker.expect(expect_ids, expect_roots, caps(), torch.device("cpu"))
        uploads.clear()
        safe, refused = checker.check(IDS, tb, ROOTS, caps())
        return len(uploads), safe, refused, checker.verdicts()

    def baseline(mutate=None):
        tb = batch()
        if mutate is not None:
            mutate(tb)
        checker = TreeChecker(V, L)
        safe, refused = checker.check(IDS, tb, ROOTS, caps())
        return safe, refused, checker.verdicts()

    def one_short(tb):  # row 1 answered with one node fewer than its cap (a valid-looking count, not the guess)
        tb.n_nodes[1] -= 1

    def bad_vocab(tb):
        tb.tokens[2, 3] = V

    cases = [(IDS, ROOTS, None, 0), (IDS, ROOTS, bad_vocab, 0),  # the guess holds: nothing uploaded now
             (IDS[::-1], ROOTS[::-1], None, 1), (IDS, [4, 5, 7, 9], None, 1), (IDS, ROOTS, one_short, 1)]
    for ids, roots, mutate, n_uploads in cases:
        got_uploads, safe, refused, verdicts = run(ids, roots, mutate)
        want = baseline(mutate)
        assert got_uploads == n_uploads, (ids, roots, mutate)
        assert (refused, verdicts) == want[1:], (ids, roots, mutate)
        for f in ("tokens", "parent", "depth"):
            assert torch.equal(getattr(safe, f), getattr(want[0], f)), f
    # judged against the count it really has (by the guess, the full tree, it would have passed)
    assert "count" in run(IDS, ROOTS, one_short)[3] and "count" not in baseline()[2]


def test_check_graphs_only_take_the_static_counts_on_their_device():
    """CheckGraphs.run declines (-> the eager launch) unless the counts are its static buffer for that batch size
    and the trees live on its device; expect() fills that buffer. (Replays themselves need a GPU: below.)"""
    from verifier_service.tree_check_graphs import CheckGraphs

    graphs = CheckGraphs(torch.device("cpu"), V, L)
    checker = TreeChecker(V, L, graphs)
    checker.expect(IDS, ROOTS, caps(), torch.device("cpu"))
    static = graphs.counts(4)
    assert static.tolist() == [caps(), ROOTS] and graphs.counts(4) is static
    packed = batch().pack()
    assert graphs.run(packed, static.clone()) is None  # not the static buffer
    assert graphs.run(packed[:, :3].contiguous(), graphs.counts(4)) is None  # another batch size
    meta = CheckGraphs(torch.device("meta"), V, L)
    assert meta.run(packed, meta.counts(4)) is None and graphs.stats == {"replays": 0, "captures": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_check_graphs_replay_gives_the_eager_checks_results():
    """Trees written step after step into one buffer (as the drafter writes the response region), counts uploaded
    ahead: the graphed checker replays one graph per (buffer, R, M) and returns what the eager checker returns,
    refusals and verdicts included; other counts or another buffer run eagerly or capture anew."""
    from verifier_service.tree_check_graphs import CheckGraphs

    dev = torch.device("cuda")
    region = torch.empty(6 * 4 * 64, dtype=torch.int32, device=dev)
    graphs = CheckGraphs(dev, V, L)
    graphed, eager = TreeChecker(V, L, graphs), TreeChecker(V, L)
    for step in range(6):
        tb = batch()
        if step % 2:  # break one row a different way each odd step (vocab, then siblings, then both)
            if step in (1, 5):
                tb.tokens[2, 3] = V
            if step in (3, 5):
                i, j = siblings(tb, 3)
                tb.tokens[3, j] = tb.tokens[3, i]
        M = tb.tokens.shape[1]
        view = region[: 6 * 4 * M].view(6, 4, M)
        view.copy_(tb.pack().to(dev))
        in_region = TreeBatch.from_packed(view, tb.n_nodes)
        graphed.expect(IDS, ROOTS, caps(), dev)
        eager.expect(IDS, ROOTS, caps(), dev)
        got, refused_g = graphed.check(IDS, in_region, ROOTS, caps(), fixed=True)
        want, refused_e = eager.check(IDS, TreeBatch.from_packed(view.clone(), tb.n_nodes), ROOTS, caps())
        for f in ("tokens", "parent", "depth"):
            assert torch.equal(getattr(got, f), getattr(want, f)), (step, f)
        assert refused_g == refused_e and graphed.verdicts() == eager.verdicts()
    assert graphs.stats == {"replays": 6, "captures": 1}
    graphed.expect(IDS[:3], ROOTS[:3], caps()[:3], dev)  # a batch of 3: its own counts buffer and graph
    part = TreeBatch.from_packed(region[: 6 * 3 * M].view(6, 3, M), batch().n_nodes[:3])
    part.packed.copy_(batch().pack()[:, :3].to(dev))
    graphed.check(IDS[:3], part, ROOTS[:3], caps()[:3], fixed=True)
    assert graphs.stats == {"replays": 7, "captures": 2}
    graphed.check(IDS, in_region, ROOTS, caps(), fixed=True)  # no expect(): counts uploaded now, the eager launch
    graphed.expect(IDS, ROOTS, caps(), dev)
    graphed.check(IDS, in_region, ROOTS, caps())  # not fixed (trees from the wire, a new place each step): eager
    assert graphs.stats["replays"] == 7


def test_trees_in_the_peers_region_are_checked_in_a_copy(monkeypatch):
    """The kernel reads a node more than once, so trees in the peer's region (fixed=True) are checked in a copy
    of the verifier's own (a peer writing meanwhile cannot make what is checked differ from what is verified);
    trees the verifier owns already (from the wire) are checked where they are."""
    from verifier_service import tree_verdicts

    seen = []
    real = tree_verdicts.check_packed
    monkeypatch.setattr(tree_verdicts, "check_packed", lambda p, *a: (seen.append(p.data_ptr()), real(p, *a))[1])
    region = batch().pack().contiguous()
    for fixed in (True, False):
        TreeChecker(V, L).check(IDS, TreeBatch.from_packed(region, batch().n_nodes), ROOTS, caps(), fixed=fixed)
    assert seen[0] != region.data_ptr() and seen[1] == region.data_ptr()
