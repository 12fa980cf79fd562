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
-1 (logw -inf). Vectorised over [R, M] with one host read; messages are built for failing rows.
"""

from __future__ import annotations

import torch

from kernels.tree_build import TreeBatch

_INT_FIELDS = ("tokens", "parent", "depth", "first_child", "next_sibling")


def _expected_fcns(par: torch.Tensor, nonroot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """first_child / next_sibling [R, M] int64 implied by parent (only nonroot nodes count as children)."""
    R, M = par.shape
    idx = torch.arange(M, device=par.device)
    child = nonroot[:, None, :] & (par[:, None, :] == idx[None, :, None])  # [R, p, c]: c is a child of p
    first = torch.where(child, idx[None, None, :], M).amin(-1)  # [R, M]
    fc = torch.where(first == M, -1, first)
    later_sib = (nonroot[:, :, None] & nonroot[:, None, :] & (par[:, :, None] == par[:, None, :])
                 & (idx[None, None, :] > idx[None, :, None]))  # [R, i, j]: j is a later sibling of i
    nxt = torch.where(later_sib, idx[None, None, :], M).amin(-1)
    ns = torch.where(nxt == M, -1, nxt)
    return fc, ns


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
    dev = trees.tokens.device
    tok, par, dep, fc, ns = (getattr(trees, f).long() for f in _INT_FIELDS)
    lw = trees.logw.float()
    n = torch.tensor([min(max(k, 0), M) for k in trees.n_nodes], device=dev)
    idx = torch.arange(M, device=dev)
    valid = idx[None, :] < n[:, None]  # [R, M]
    nonroot = valid & (idx[None, :] >= 1)
    parc = par.clamp(0, M - 1)
    par_ok = nonroot & (par >= 0) & (par < idx[None, :])
    exp_fc, exp_ns = _expected_fcns(torch.where(par_ok, par, -1), par_ok)
    same_par = par_ok[:, :, None] & par_ok[:, None, :] & (par[:, :, None] == par[:, None, :])
    dup_sib = (same_par & (tok[:, :, None] == tok[:, None, :]) & (idx[None, :, None] != idx[None, None, :])).any(-1)
    first_col = idx[None, :] == 0
    roots_t = torch.tensor(roots, device=dev)[:, None]
    # (bad nodes [R, M], message(r, i)) in the order they are reported; the first failing check wins
    checks = [
        (first_col & (tok != roots_t), lambda r, i: f"root token {tok[r, 0].item()} is not the session's root "
                                                    f"token {roots[r]}"),
        (first_col & ((par != -1) | (dep != 0)),
         lambda r, i: f"node 0 must be the root (parent -1, depth 0), got parent {par[r, 0].item()} "
                      f"depth {dep[r, 0].item()}"),
        (first_col & (lw != 0), lambda r, i: f"root logw must be 0, got {lw[r, 0].item()}"),
        (nonroot & ~par_ok, lambda r, i: f"node {i} has parent {par[r, i].item()}, which is not an earlier node "
                                         "(a tree has one root and parents precede children)"),
        (par_ok & (dep != dep.gather(1, parc) + 1),
         lambda r, i: f"node {i} has depth {dep[r, i].item()} but its parent {par[r, i].item()} has depth "
                      f"{dep[r, par[r, i]].item()}"),
        (valid & (dep > max_depth), lambda r, i: f"node {i} has depth {dep[r, i].item()} > the drafter's "
                                                 f"{max_depth}"),
        (valid & ((tok < 0) | (tok >= vocab_size)),
         lambda r, i: f"node {i} has token id {tok[r, i].item()} outside the vocabulary [0, {vocab_size})"),
        (valid & ~torch.isfinite(lw), lambda r, i: f"node {i} has a non-finite logw {lw[r, i].item()}"),
        (par_ok & (lw > lw.gather(1, parc)),
         lambda r, i: f"node {i} has logw {lw[r, i].item()} above its parent's {lw[r, par[r, i]].item()}"),
        (dup_sib & par_ok, lambda r, i: f"node {i} repeats the token {tok[r, i].item()} of a sibling "
                                        f"under parent {par[r, i].item()}"),
        (valid & (fc != exp_fc), lambda r, i: f"node {i} has first_child {fc[r, i].item()}, but parent implies "
                                              f"{exp_fc[r, i].item()}"),
        (valid & (ns != exp_ns), lambda r, i: f"node {i} has next_sibling {ns[r, i].item()}, but parent implies "
                                              f"{exp_ns[r, i].item()}"),
        (~valid & ((tok != -1) | (par != -1) | (dep != -1) | (fc != -1) | (ns != -1) | (lw != float("-inf"))),
         lambda r, i: f"padding column {i} (n_nodes {trees.n_nodes[r]}) is not -1 / -inf"),
    ]
    bad = torch.stack([b for b, _ in checks], 1)  # [R, C, M]
    any_bad = bad.any(-1)  # [R, C]
    first_node = bad.int().argmax(-1)  # [R, C]
    host = torch.cat((any_bad.long(), first_node.long()), 1).cpu().tolist()  # the one host read
    C = len(checks)
    for r in range(R):
        if errors[r] is not None:
            continue
        for c in range(C):
            if host[r][c]:
                errors[r] = checks[c][1](r, host[r][C + c])
                break
    return errors
