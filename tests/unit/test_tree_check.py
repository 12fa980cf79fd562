"""kernels.tree_check: the one-launch device tree checks against the torch reference and the numpy host path.

- every invalid case of test_tree_validation (except the n_nodes range, a host check) and valid trees: the
  kernel (TRITON_INTERPRET=1 on CPU), the reference and `check_codes` give the same code, naming the rule;
- fuzz: real trees of awkward sizes with random corruptions (NaN, infinities, extreme ints, padding
  columns) and shrunk or out-of-range node counts: same codes, same sanitized trees, inputs untouched;
- strided inputs, empty batches, bad arguments; on a GPU: 64 rows of 65 nodes, and CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch

from kernels.graph_capture import GraphCapture
from kernels.tree_build import TreeBatch, build_tree
from kernels.tree_check import CHECKS, check_packed, check_trees, check_trees_reference
from tests.unit.test_tree_validation import CASES, ROOTS, L, V, make
from verifier_service.tree_validation import _checks, check_codes

FIELDS = TreeBatch._FIELDS  # tokens, parent, depth, first_child, next_sibling, logw
EXPECTED = {  # test_tree_validation case -> the rule that must fail first
    "root token": "root_token", "root parent": "root_node", "root depth": "root_node", "root logw": "root_logw",
    "self parent": "parent_order", "forward parent": "parent_order", "second root": "parent_order",
    "parent out of range": "parent_order", "depth vs parent": "depth_step", "token id negative": "vocab",
    "token id past the vocabulary": "vocab", "logw nan": "logw_finite", "logw -inf": "logw_finite",
    "logw rises along an edge": "logw_rises", "siblings repeat a token": "dup_sibling",
    "first_child": "first_child", "next_sibling": "next_sibling", "padding": "padding",
}
HOST_ONLY = {"n_nodes over the budget", "no nodes"}  # the n_nodes range is checked on the host, not here
TREE_CASES = [c for c in CASES if c[0] not in HOST_ONLY]


def tensors(tb: TreeBatch, roots: list[int]) -> list[torch.Tensor]:
    """check_trees' tensor arguments for a TreeBatch whose n_nodes may hold any ints."""
    n_nodes = torch.tensor(tb.n_nodes, dtype=torch.int32)  # the fuzz keeps them inside int32
    return [getattr(tb, f) for f in FIELDS] + [n_nodes, torch.tensor(roots, dtype=torch.int32)]


def expected_outputs(args: list[torch.Tensor], codes: list[int]) -> list[torch.Tensor]:
    """The sanitized tokens/parent/depth, row by row from the rule in check_trees' docstring."""
    tok, par, dep = (t.clone() for t in args[:3])
    n_nodes, roots = args[6], args[7]
    M = tok.shape[1]
    for r, code in enumerate(codes):
        if code:
            n = min(max(int(n_nodes[r]), 0), M)
            tok[r], par[r], dep[r] = -1, -1, -1
            tok[r, 1:n], par[r, 1:n], dep[r, 1:n] = -1, 0, 1
            tok[r, 0], par[r, 0], dep[r, 0] = int(roots[r]), -1, 0
    return [tok, par, dep]


def assert_rows_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype, want.shape, want.dtype)
    diff = (got != want).reshape(len(got), -1).any(-1) if got.numel() else torch.zeros(0, dtype=torch.bool)
    if diff.any():
        r = int(diff.nonzero()[0])
        raise AssertionError(f"{what}: row {r} differs:\n got  {got[r].tolist()}\n want {want[r].tolist()}")


def run_all(tb: TreeBatch, roots: list[int], vocab: int, max_depth: int) -> list[int]:
    """Kernel, reference and numpy agree on the codes; kernel and reference on the sanitized trees,
    which follow the rule; the inputs are not modified. Returns the codes."""
    args = tensors(tb, roots)
    before = [a.clone() for a in args]
    kern = check_trees(*args, vocab, max_depth, impl="triton")
    ref = check_trees_reference(*args, vocab, max_depth)
    host = check_codes(tb, roots, vocab, max_depth)
    assert kern[0].tolist() == ref[0].tolist() == host, (kern[0].tolist(), ref[0].tolist(), host)
    for name, k, r, e in zip(("tokens", "parent", "depth"), kern[1:], ref[1:], expected_outputs(args, host)):
        assert_rows_equal(k, r, f"kernel vs reference {name}")
        assert_rows_equal(k, e, f"kernel vs rule {name}")
    packed = TreeBatch(*args[:6], list(tb.n_nodes)).pack()  # the same trees as one [6, R, M] buffer
    for impl in ("triton", "torch"):
        for name, k, p in zip(("codes", "tokens", "parent", "depth"), kern,
                              check_packed(packed, args[6], args[7], vocab, max_depth, impl=impl)):
            assert_rows_equal(p, k, f"check_packed ({impl}) vs check_trees {name}")
    for a, b in zip(args, before):  # bitwise, so NaN logw compare equal
        assert torch.equal(a.view(torch.int32) if a.is_floating_point() else a,
                           b.view(torch.int32) if b.is_floating_point() else b)
    return host


def test_check_names_are_the_host_checks():
    tb = make()
    assert tuple(name for name, _, _ in _checks(tb, ROOTS, V, L)) == CHECKS


def test_valid_trees_pass():
    for seed in range(5):
        assert run_all(make(seed), ROOTS, V, L) == [0, 0, 0]


def prefix(tb: TreeBatch, r: int, n: int) -> None:
    """Cut row r to its first n nodes, a valid smaller tree (test_a_smaller_tree_than_the_budget_is_valid)."""
    tb.n_nodes[r] = n
    for f in ("tokens", "parent", "depth"):
        getattr(tb, f)[r, n:] = -1
    tb.logw[r, n:] = float("-inf")
    fc, ns = tb.first_child[r], tb.next_sibling[r]
    fc[fc >= n], ns[ns >= n] = -1, -1
    fc[n:], ns[n:] = -1, -1


def test_a_smaller_tree_than_the_budget_is_valid():
    tb = make()
    prefix(tb, 1, 4)
    assert run_all(tb, ROOTS, V, L) == [0, 0, 0]


def test_every_host_case_is_covered():
    assert {c[0] for c in CASES} == set(EXPECTED) | HOST_ONLY


@pytest.mark.parametrize("name, mutate, words", TREE_CASES, ids=[c[0] for c in TREE_CASES])
def test_each_invalid_tree_fails_its_rule_for_its_row_only(name, mutate, words):
    tb = make()
    mutate(tb)
    assert run_all(tb, ROOTS, V, L) == [0, 1 + CHECKS.index(EXPECTED[name]), 0]


def test_depth_beyond_the_drafter():
    tb = make()
    deepest = [int(tb.depth[r].max()) for r in range(3)]
    codes = run_all(tb, ROOTS, V, deepest[1] - 1)
    assert codes[1] == 1 + CHECKS.index("max_depth")


# --- fuzz -----------------------------------------------------------------------------------------------
def draw(g: torch.Generator, hi: int, lo: int = 0) -> int:
    return int(torch.randint(lo, hi, (1,), generator=g))


def real_trees(g: torch.Generator, R: int, M: int) -> tuple[TreeBatch, list[int]]:
    """R trees from build_tree, the widest with exactly M nodes; budgets and top-k vary per row."""
    budgets = [draw(g, M) for _ in range(R)]
    topks = [draw(g, 6, 1) for _ in range(R)]
    w = draw(g, R)
    budgets[w], topks[w] = M - 1, max(topks[w], 3)
    logits = torch.randn(R, L, V, generator=g) * [0.5, 3.0, 30.0][draw(g, 3)]
    if draw(g, 4) == 0:
        logits = logits.round()  # equal log-probs: ties in the build order and in logw
    roots = [draw(g, V) for _ in range(R)]
    tb = build_tree(torch.log_softmax(logits, -1), torch.tensor(roots), budgets, topks)
    assert tb.tokens.shape[1] == M
    return tb, roots


def corrupt(g: torch.Generator, tb: TreeBatch) -> None:
    """Set one random field of one random node (padding columns included) to an awkward value."""
    R, M = tb.tokens.shape
    r, i, f = draw(g, R), draw(g, M), FIELDS[draw(g, len(FIELDS))]
    t = getattr(tb, f)
    if f == "logw":
        p = min(max(int(tb.parent[r, i]), 0), M - 1)
        lw_par = float(tb.logw[r, p])
        values = [float("nan"), float("-inf"), float("inf"), 0.0, lw_par + 0.5, lw_par, float(t[r, i]) - 1e-3,
                  -1e30, 3e38, -0.0]
        t[r, i] = values[draw(g, len(values))]
        return
    sibs = [j for j in range(M) if j != i and int(tb.parent[r, j]) == int(tb.parent[r, i])]
    other = sibs[draw(g, len(sibs))] if sibs else draw(g, M)
    if f == "tokens" and draw(g, 2):
        t[r, i] = int(t[r, other])  # a sibling's token (a repeat, or harmless when i is padding)
        return
    values = [-1, 0, 1, M - 1, M, V - 1, V, i, i - 1, i + 1, int(t[r, i]) + 1, int(t[r, other]), 2**31 - 1,
              -2**31, draw(g, M + 4, -3)]
    t[r, i] = values[draw(g, len(values))]


def fuzz_batch(g: torch.Generator, R: int, M: int, n_corrupt: int) -> tuple[TreeBatch, list[int], int, int]:
    """Real trees, some cut to a valid prefix or given a wrong node count, with n_corrupt corruptions;
    -> (trees, roots to check against, vocab size, max depth)."""
    tb, roots = real_trees(g, R, M)
    for r in range(R):
        kind = draw(g, 20)
        if kind < 4:
            prefix(tb, r, draw(g, tb.n_nodes[r] + 1, 1))
        elif kind == 4:
            tb.n_nodes[r] = draw(g, tb.n_nodes[r] + 1, 1)  # padding left behind
        elif kind == 5:
            tb.n_nodes[r] = [0, -3, M + 5, 2**31 - 1][draw(g, 4)]  # never sent, but the kernel must clamp
        elif kind == 6:
            roots[r] = (roots[r] + 1) % V
    for _ in range(n_corrupt):
        corrupt(g, tb)
    vocab = V if draw(g, 6) else draw(g, V + 1, 1)
    max_depth = L if draw(g, 6) else draw(g, L)
    return tb, roots, vocab, max_depth


@pytest.mark.parametrize("M, batches", [(2, 60), (7, 60), (17, 60), (33, 60), (65, 60), (256, 20)])
def test_fuzz_kernel_reference_and_host_agree(M, batches):
    g = torch.Generator().manual_seed(1000 + M)
    seen = set()
    for _ in range(batches):
        tb, roots, vocab, max_depth = fuzz_batch(g, draw(g, 6, 1), M, draw(g, 4))
        seen.update(run_all(tb, roots, vocab, max_depth))
    assert 0 in seen and len(seen) >= 4, seen  # valid rows and several different failures


def test_strided_inputs_give_the_same_results():
    """Column slices of wider tensors, column-major copies and strided n_nodes / roots."""
    g = torch.Generator().manual_seed(5)
    tb, roots, vocab, max_depth = fuzz_batch(g, 5, 17, 6)
    args = tensors(tb, roots)
    R, M = tb.tokens.shape
    strided = []
    for k, a in enumerate(args[:6]):
        if k % 2:
            strided.append(a.t().contiguous().t())  # strides (1, R)
        else:
            wide = torch.full((R, 2 * M), float("nan") if a.is_floating_point() else 7777, dtype=a.dtype)
            wide[:, 1::2] = a
            strided.append(wide[:, 1::2])  # strides (2M, 2)
    strided += [torch.stack([a, a + 99], 1)[:, 0] for a in args[6:]]  # strides (2,)
    assert not any(s.is_contiguous() for s in strided)
    want = check_trees_reference(*args, vocab, max_depth)
    for impl in ("triton", "torch"):
        got = check_trees(*strided, vocab, max_depth, impl=impl)
        for k, w, what in zip(got, want, ("codes", "tokens", "parent", "depth")):
            assert_rows_equal(k, w, f"{impl} {what}")


@pytest.mark.parametrize("R, M", [(0, 5), (3, 0), (0, 0), (2, 1)])
def test_empty_and_tiny_shapes(R, M):
    i32 = torch.int32
    fields = [torch.full((R, M), -1, dtype=i32) for _ in range(5)] + [torch.full((R, M), float("-inf"))]
    if M:
        fields[0][:, 0], fields[2][:, 0], fields[5][:, 0] = 3, 0, 0.0  # the root alone
    n, roots = torch.ones(R, dtype=i32), torch.full((R,), 3, dtype=i32)
    for impl in ("triton", "torch"):
        codes, *outs = check_trees(*fields, n, roots, V, L, impl=impl)
        assert codes.tolist() == [0] * R and codes.dtype == i32
        for o, f in zip(outs, fields):
            assert o.shape == (R, M) and o.dtype == i32 and torch.equal(o, f)
            assert o is not f


def test_bad_arguments():
    tb = make()
    args = tensors(tb, ROOTS)
    with pytest.raises(ValueError, match="at most 256"):
        check_trees(*(torch.full((3, 257), -1, dtype=a.dtype) for a in args[:6]), *args[6:], V, L)
    with pytest.raises(ValueError, match="parent must be"):
        check_trees(args[0], args[1].long(), *args[2:], V, L)
    with pytest.raises(ValueError, match="logw must be"):
        check_trees(*args[:5], args[5].double(), *args[6:], V, L)
    with pytest.raises(ValueError, match="n_nodes must be"):
        check_trees(*args[:6], args[6][:2], args[7], V, L)
    with pytest.raises(ValueError, match="impl"):
        check_trees(*args, V, L, impl="cuda")
    packed = TreeBatch(*args[:6], list(tb.n_nodes)).pack()
    with pytest.raises(ValueError, match=r"\[6, R, M\] int32 contiguous"):
        check_packed(packed[:5], *args[6:], V, L)
    with pytest.raises(ValueError, match="not contiguous"):
        check_packed(packed.transpose(1, 2), *args[6:], V, L)
    with pytest.raises(ValueError, match="roots must be"):
        check_packed(packed, args[6], args[7][:1], V, L)
    with pytest.raises(ValueError, match="at most 256"):
        check_packed(torch.full((6, 2, 257), -1, dtype=torch.int32), args[6][:2], args[7][:2], V, L)


def test_auto_on_cpu_is_the_reference():
    tb = make()
    mutate = dict((c[0], c[1]) for c in CASES)["siblings repeat a token"]
    mutate(tb)
    args = tensors(tb, ROOTS)
    for got, want in zip(check_trees(*args, V, L), check_trees_reference(*args, V, L)):
        assert torch.equal(got, want)


# --- GPU ------------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@pytest.mark.gpu
def test_gpu_kernel_matches_the_reference_at_64_rows_of_65_nodes():
    g = torch.Generator().manual_seed(64)
    for _ in range(5):
        tb, roots, vocab, max_depth = fuzz_batch(g, 64, 65, 48)
        args = tensors(tb, roots)
        ref = check_trees_reference(*args, vocab, max_depth)
        dev = [a.cuda() for a in args]
        check_trees(*dev, vocab, max_depth)  # warm-up (compiles)
        torch.cuda.set_sync_debug_mode("error")  # any host synchronisation now raises
        try:
            got = check_trees(*dev, vocab, max_depth)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert got[0].cpu().tolist() == ref[0].tolist() == check_codes(tb, roots, vocab, max_depth)
        for k, w, what in zip(got[1:], ref[1:], ("tokens", "parent", "depth")):
            assert_rows_equal(k.cpu(), w, what)


@gpu
@pytest.mark.gpu
def test_gpu_check_trees_runs_inside_a_cuda_graph():
    g = torch.Generator().manual_seed(65)
    batches = [fuzz_batch(g, 64, 65, 48) for _ in range(3)]
    vocab, max_depth = V, L  # baked into the graph
    static = [a.cuda() for a in tensors(batches[0][0], batches[0][1])]
    graph, out = GraphCapture("cuda").capture(lambda: check_trees(*static, vocab, max_depth))
    for tb, roots, _, _ in batches:
        args = tensors(tb, roots)
        for s, a in zip(static, args):
            s.copy_(a)
        graph.replay()
        ref = check_trees_reference(*args, vocab, max_depth)
        for k, w, what in zip(out, ref, ("codes", "tokens", "parent", "depth")):
            assert_rows_equal(k.cpu(), w, f"graph replay {what}")
