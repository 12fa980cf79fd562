"""Tree acceptance on the device (DESIGN 3.2): which draft path the target agrees with.

Owns `accept_greedy` (vectorised torch, fixed-shape, no host sync), `accept_tree` (its launcher: the same results
from one Triton launch, a program per tree, on CUDA; ~40 torch launches at 17 nodes otherwise, six rounds of pointer
jumping among them) and `accept_reference` (the plain walk the tests compare against). All take the per-node
*posterior* token y_i generically: the argmax of the target logits at node i for greedy decoding, or a Gumbel-max
sample keyed by (seed, position) for sampling, so sampling reuses this code unchanged.

The kernel walks each node's parent chain (at most M steps, as `kernels.tree_inputs` does), so it sees the same
ancestor sets as `ancestor_mask`'s pointer jumping for any parent array, cycles included (every node reachable within
M - 1 steps), and takes the same ties: the first deepest accepted node, the largest index per depth on its path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.step_impl import use_kernel
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


@triton.jit(do_not_specialize=["M", "max_depth"])  # no recompiles as the step's tree width varies
def _accept_kernel(tok_ptr, parent_ptr, n_ptr, post_ptr, len_ptr, path_ptr, bonus_ptr, last_ptr, M, max_depth,
                   D1: tl.constexpr, BM: tl.constexpr, WB: tl.constexpr, DB: tl.constexpr):
    r = tl.program_id(0)
    base = r.to(tl.int64) * M
    i = tl.arange(0, BM)
    inrow = i < M
    n = tl.load(n_ptr + r)
    words = tl.arange(0, WB)
    one = tl.full([BM, WB], 1, tl.int64)
    bits = tl.zeros([BM, WB], dtype=tl.int64)  # the node's ancestor set, itself included (`ancestor_mask` rows)
    count = tl.zeros([BM], dtype=tl.int32)  # its size: depth + 1
    all_ok = tl.full([BM], 1, tl.int32)  # every node of the set agrees with the posterior at its parent
    cur = tl.where(inrow, i, -1).to(tl.int64)
    for _ in range(0, M):
        on = cur >= 0
        k = tl.where(on, cur % 64, 0)
        hit = on[:, None] & (words[None, :] == (cur // 64)[:, None])
        had = tl.sum(tl.where(hit, (bits >> k[:, None]) & 1, 0), axis=1) > 0
        count += (on & ~had).to(tl.int32)
        bits = bits | tl.where(hit, one << k[:, None], 0)
        live = on & (cur < n)  # a node of the tree (`valid`)
        p = tl.load(parent_ptr + base + cur, mask=live, other=-1)
        par = tl.where(live & (p >= 0) & (p < M), p, -1)
        t = tl.load(tok_ptr + base + cur, mask=live, other=0)
        y = tl.load(post_ptr + base + tl.maximum(par, 0), mask=live, other=0)
        ok = (live & (par >= 0) & (t == y)) | (cur == 0)
        all_ok = all_ok & (~on | ok).to(tl.int32)
        cur = tl.where(on, par, -1)
    depth = count - 1
    accepted = (all_ok != 0) & inrow & (i < n) & (depth <= max_depth)
    key = tl.where(accepted, depth, -1)
    key = tl.where(inrow, key, -2)  # lanes past M are no nodes at all
    last = tl.min(tl.where(key == tl.max(key, axis=0), i, BM), axis=0)  # the first deepest accepted node
    tl.store(len_ptr + r, tl.sum(tl.where(i == last, depth, 0), axis=0))
    tl.store(bonus_ptr + r, tl.load(post_ptr + base + last).to(tl.int32))
    tl.store(last_ptr + r, last)
    # its path: the nodes of its ancestor set, the largest index at each depth (-1 where none)
    row = tl.sum(tl.where((i == last)[:, None], bits, 0), axis=0)  # [WB]
    word = tl.sum(tl.where(words[None, :] == (i // 64)[:, None], row[None, :], 0), axis=1)  # [BM]
    on_path = inrow & (((word >> (i % 64)) & 1) != 0)
    levels = tl.arange(0, DB)
    hit = on_path[None, :] & (depth[None, :] == levels[:, None])
    path = tl.max(tl.where(hit, i[None, :], -1), axis=1)
    tl.store(path_ptr + r.to(tl.int64) * D1 + levels, path, mask=levels < D1)


def accept_tree(tokens: Tensor, parent: Tensor, n_nodes: Tensor, posterior: Tensor, max_depth: int,
                impl: str = "auto") -> AcceptResult:
    """`accept_greedy`'s contract and results. impl: auto (one Triton launch on CUDA, the torch code elsewhere),
    triton (on CPU needs TRITON_INTERPRET=1) or torch. No host reads: stream-ordered, graph-capturable."""
    if not use_kernel(impl, tokens.is_cuda):
        return accept_greedy(tokens, parent, n_nodes, posterior, max_depth)
    R, M = tokens.shape
    if parent.shape != (R, M) or posterior.shape != (R, M) or n_nodes.shape != (R,) or max_depth < 0:
        raise ValueError(f"accept_tree: shapes tokens {tuple(tokens.shape)}, parent {tuple(parent.shape)}, "
                         f"posterior {tuple(posterior.shape)}, n_nodes {tuple(n_nodes.shape)}, max_depth {max_depth}")
    dev, i32 = tokens.device, torch.int32
    out = AcceptResult(torch.empty(R, dtype=i32, device=dev), torch.empty(R, max_depth + 1, dtype=i32, device=dev),
                       torch.empty(R, dtype=i32, device=dev), torch.empty(R, dtype=i32, device=dev))
    if R and M:
        _accept_kernel[(R,)](tokens.long().contiguous(), parent.long().contiguous(), n_nodes.long().contiguous(),
                             posterior.long().contiguous(), out.accept_len, out.path, out.bonus, out.last, M,
                             max_depth, D1=max_depth + 1, BM=triton.next_power_of_2(M),
                             WB=triton.next_power_of_2(triton.cdiv(M, 64)), DB=triton.next_power_of_2(max_depth + 1))
    elif R:  # no nodes at all: what the torch code gives (argmax of nothing is not defined there either)
        return accept_greedy(tokens, parent, n_nodes, posterior, max_depth)
    return out
