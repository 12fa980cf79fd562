"""Tree acceptance on the device (DESIGN 3.2): which draft path the target agrees with.

Owns `accept_greedy` (vectorised, fixed-shape, no host sync) and `accept_reference` (the plain
walk the tests compare against). Both take the per-node *posterior* token y_i generically: the
argmax of the target logits at node i for greedy decoding, or a Gumbel-max sample keyed by
(seed, position) for sampling, so sampling reuses this code unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.tree_mask import ancestor_mask


@dataclass
class AcceptResult:
    accept_len: Tensor  # [R] int32, accepted draft nodes (root not counted), 0..max_depth
    path: Tensor  # [R, max_depth+1] int32, accepted node indices by depth (node 0 first), -1 = none
    bonus: Tensor  # [R] int32, posterior token of the deepest accepted node (the next root)
    last: Tensor  # [R] int32, index of the deepest accepted node


def accept_greedy(
    tokens: Tensor, parent: Tensor, n_nodes: Tensor, posterior: Tensor, max_depth: int
) -> AcceptResult:
    """Accept the longest tree path that the posterior tokens follow from the root.

    tokens, parent: [R, M] int (tree, -1 padding); n_nodes: [R] int on the same device;
    posterior: [R, M] int, y_i per node. ok[i] = tokens[i] == y[parent[i]] for 0 < i < n_nodes;
    node i is accepted iff it and all its non-root ancestors are ok (the root always is). Nodes
    deeper than max_depth are never accepted. Siblings must carry distinct tokens (build_tree
    guarantees it); then the accepted nodes form one chain and its deepest node is unique.
    """
    R, M = tokens.shape
    dev = tokens.device
    idx = torch.arange(M, device=dev)  # [M]
    valid = idx[None, :] < n_nodes.to(torch.int64)[:, None]  # [R, M] bool
    par = torch.where(valid & (parent >= 0) & (parent < M), parent.long(), -1)  # [R, M] int64
    anc = ancestor_mask(par)  # [R, M, M] bool, row i = i and its ancestors
    depth = anc.sum(-1) - 1  # [R, M] int64, 0 for roots of their own

    y_par = posterior.long().gather(1, par.clamp(min=0))  # [R, M] posterior at the parent
    ok = (valid & (par >= 0) & (tokens.long() == y_par)) | (idx[None, :] == 0)
    # accepted iff no node on the ancestor chain (itself included) fails
    accepted = ~(anc & ~ok[:, None, :]).any(-1) & valid & (depth <= max_depth)  # [R, M]

    key = torch.where(accepted, depth, -1)
    last = key.argmax(1)  # [R] int64; the root (depth 0) is always a candidate
    accept_len = depth.gather(1, last[:, None]).squeeze(1)
    bonus = posterior.gather(1, last[:, None]).squeeze(1)

    # path[r, k] = the ancestor of `last` at depth k (-1 past accept_len)
    on_path = anc.gather(1, last[:, None, None].expand(R, 1, M)).squeeze(1)  # [R, M] bool
    levels = torch.arange(max_depth + 1, device=dev)  # [D+1]
    hit = on_path[:, None, :] & (depth[:, None, :] == levels[None, :, None])  # [R, D+1, M]
    path = torch.where(hit, idx[None, None, :], -1).amax(-1)  # [R, D+1]
    i32 = torch.int32
    return AcceptResult(accept_len.to(i32), path.to(i32), bonus.to(i32), last.to(i32))


def accept_reference(
    tokens: list[int], parent: list[int], n_nodes: int, posterior: list[int], max_depth: int
) -> tuple[int, list[int], int]:
    """One request, plain walk: from the root, move to the child whose token is y[cur].

    Returns (accept_len, path padded with -1 to max_depth+1 entries, bonus)."""
    cur, path = 0, [0]
    while len(path) - 1 < max_depth:
        nxt = [c for c in range(1, n_nodes) if parent[c] == cur and tokens[c] == posterior[cur]]
        if not nxt:
            break
        cur = nxt[0]
        path.append(cur)
    return len(path) - 1, path + [-1] * (max_depth + 1 - len(path)), posterior[cur]
