"""Checks on draft trees received from another process, before the engine touches them.

A tree from the wire is untrusted: a wrong parent index, a repeated sibling token or a node count
past the KV reservation would corrupt the verify step or the cache. `validate_trees` checks every
row of a decoded `TreeBatch` against what the session asked for and returns one message per row
(None = valid), so that one bad tree fails only its own session. The ancestor mask is never read
from the wire; it is derived from `parent` after these checks.

Rules (DESIGN 3.1): 1 <= n_nodes <= min(tree_size(budget, topk, depth), M); node 0 is the one root
(token = the session's root token, parent -1, depth 0, logw 0); every other node i < n_nodes has
0 <= parent < i, depth = depth(parent) + 1 <= max depth, a token id in the vocabulary, a finite
logw no larger than its parent's; siblings carry distinct tokens; first_child / next_sibling
equal the ones `parent` implies (smallest child; smallest later sibling); padding columns hold
-1 (logw -inf). Vectorised over [R, M] in numpy on host copies; messages are built for failing rows.
`check_codes` reports the same per-node rules as numbers, the host twin of `kernels.tree_check.check_trees`.
The stream client checks every step's trees on the device with that kernel (no host copy, no host
sync, `verifier_service.tree_verdicts`) and comes here only for the rows it refused, to say why.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kernels.tree_build import TreeBatch

_INT_FIELDS = ("tokens", "parent", "depth", "first_child", "next_sibling")


def _expected_fcns(par: np.ndarray, nonroot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """first_child / next_sibling [R, M] int64 implied by parent (only nonroot nodes count as children)."""
    R, M = par.shape
    idx = np.arange(M)
    child = nonroot[:, None, :] & (par[:, None, :] == idx[None, :, None])  # [R, p, c]: c is a child of p
    first = np.where(child, idx[None, None, :], M).min(-1, initial=M)  # [R, M]
    fc = np.where(first == M, -1, first)
    later_sib = (nonroot[:, :, None] & nonroot[:, None, :] & (par[:, :, None] == par[:, None, :])
                 & (idx[None, None, :] > idx[None, :, None]))  # [R, i, j]: j is a later sibling of i
    nxt = np.where(later_sib, idx[None, None, :], M).min(-1, initial=M)
    ns = np.where(nxt == M, -1, nxt)
    return fc, ns


def _checks(trees: TreeBatch, roots: list[int], vocab_size: int,
            max_depth: int) -> list[tuple[str, np.ndarray, Callable[[int, int], str]]]:
    """The per-node rules, shared by `validate_trees` and `check_codes` (arrays with M >= 1 columns).

    Names and order are kernels.tree_check.CHECKS, so the host and the device kernel agree on which rule
    a row breaks first."""
    M = trees.tokens.shape[1]
    # numpy on the host copy: a handful of [R, M] / [R, M, M] ops, each far cheaper than a torch call
    tok, par, dep, fc, ns = (getattr(trees, f).cpu().numpy().astype(np.int64) for f in _INT_FIELDS)
    lw = trees.logw.cpu().float().numpy()
    n = np.array([min(max(k, 0), M) for k in trees.n_nodes], dtype=np.int64)
    idx = np.arange(M)
    valid = idx[None, :] < n[:, None]  # [R, M]
    nonroot = valid & (idx[None, :] >= 1)
    parc = par.clip(0, M - 1)
    par_ok = nonroot & (par >= 0) & (par < idx[None, :])
    exp_fc, exp_ns = _expected_fcns(np.where(par_ok, par, -1), par_ok)
    same_par = par_ok[:, :, None] & par_ok[:, None, :] & (par[:, :, None] == par[:, None, :])
    dup_sib = (same_par & (tok[:, :, None] == tok[:, None, :]) & (idx[None, :, None] != idx[None, None, :])).any(-1)
    first_col = idx[None, :] == 0
    roots_t = np.array(roots, dtype=np.int64)[:, None]
    dep_par, lw_par = np.take_along_axis(dep, parc, 1), np.take_along_axis(lw, parc, 1)
    with np.errstate(invalid="ignore"):  # -inf / nan logw compare as they should; the checks say which
        finite = np.isfinite(lw)
        lw_up = par_ok & (lw > lw_par)
        pad_lw = lw != -np.inf
    # (name, bad nodes [R, M], message(r, i)) in the order they are reported; the first failing check wins
    return [
        ("root_token", first_col & (tok != roots_t), lambda r, i: f"root token {tok[r, 0]} is not the session's "
                                                                  f"root token {roots[r]}"),
        ("root_node", first_col & ((par != -1) | (dep != 0)),
         lambda r, i: f"node 0 must be the root (parent -1, depth 0), got parent {par[r, 0]} depth {dep[r, 0]}"),
        ("root_logw", first_col & (lw != 0), lambda r, i: f"root logw must be 0, got {lw[r, 0]}"),
        ("parent_order", nonroot & ~par_ok, lambda r, i: f"node {i} has parent {par[r, i]}, which is not an earlier "
                                                         "node (a tree has one root and parents precede children)"),
        ("depth_step", par_ok & (dep != dep_par + 1),
         lambda r, i: f"node {i} has depth {dep[r, i]} but its parent {par[r, i]} has depth {dep[r, par[r, i]]}"),
        ("max_depth", valid & (dep > max_depth),
         lambda r, i: f"node {i} has depth {dep[r, i]} > the drafter's {max_depth}"),
        ("vocab", valid & ((tok < 0) | (tok >= vocab_size)),
         lambda r, i: f"node {i} has token id {tok[r, i]} outside the vocabulary [0, {vocab_size})"),
        ("logw_finite", valid & ~finite, lambda r, i: f"node {i} has a non-finite logw {lw[r, i]}"),
        ("logw_rises", lw_up, lambda r, i: f"node {i} has logw {lw[r, i]} above its parent's {lw[r, par[r, i]]}"),
        ("dup_sibling", dup_sib & par_ok, lambda r, i: f"node {i} repeats the token {tok[r, i]} of a sibling "
                                                       f"under parent {par[r, i]}"),
        ("first_child", valid & (fc != exp_fc), lambda r, i: f"node {i} has first_child {fc[r, i]}, but parent "
                                                             f"implies {exp_fc[r, i]}"),
        ("next_sibling", valid & (ns != exp_ns), lambda r, i: f"node {i} has next_sibling {ns[r, i]}, but parent "
                                                              f"implies {exp_ns[r, i]}"),
        ("padding", ~valid & ((tok != -1) | (par != -1) | (dep != -1) | (fc != -1) | (ns != -1) | pad_lw),
         lambda r, i: f"padding column {i} (n_nodes {trees.n_nodes[r]}) is not -1 / -inf"),
    ]


def validate_trees(trees: TreeBatch, roots: list[int], max_nodes: list[int], vocab_size: int,
                   max_depth: int) -> list[str | None]:
    """One entry per row: None if the tree is valid, else what is wrong with it."""
    R, M = trees.tokens.shape
    if len(roots) != R or len(max_nodes) != R or len(trees.n_nodes) != R:
        raise ValueError(f"validate_trees: {R} trees, {len(roots)} roots, {len(max_nodes)} limits, "
                         f"{len(trees.n_nodes)} node counts")
    errors: list[str | None] = [None] * R
    for r, (n, cap) in enumerate(zip(trees.n_nodes, max_nodes)):
        if not 1 <= n <= min(cap, M):
            errors[r] = f"n_nodes {n} is outside 1..{min(cap, M)} (budget allows {cap} nodes, arrays have {M})"
    if M == 0:
        return errors
    checks = _checks(trees, roots, vocab_size, max_depth)
    bad = np.stack([b for _, b, _ in checks], 1)  # [R, C, M]
    any_bad = bad.any(-1)  # [R, C]
    first_node = bad.argmax(-1)  # [R, C]
    for r in np.flatnonzero(any_bad.any(-1)).tolist():
        if errors[r] is None:
            c = int(np.argmax(any_bad[r]))
            errors[r] = checks[c][2](r, int(first_node[r, c]))
    return errors


def check_codes(trees: TreeBatch, roots: list[int], vocab_size: int, max_depth: int) -> list[int]:
    """Per row: 0 if every per-node rule holds, else 1 + the index in kernels.tree_check.CHECKS of the first
    one broken (the host twin of `check_trees`; n_nodes is clamped to [0, M], its range is not checked here)."""
    R, M = trees.tokens.shape
    if len(roots) != R or len(trees.n_nodes) != R:
        raise ValueError(f"check_codes: {R} trees, {len(roots)} roots, {len(trees.n_nodes)} node counts")
    if M == 0:
        return [0] * R
    any_bad = np.stack([b.any(-1) for _, b, _ in _checks(trees, roots, vocab_size, max_depth)], 1)  # [R, C]
    return np.where(any_bad.any(-1), any_bad.argmax(-1) + 1, 0).tolist()
